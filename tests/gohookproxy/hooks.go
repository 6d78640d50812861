package main

// Hook servers: the registration files of the hook directory, one kept connection per server.

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// hookServer is one registered hook server: its client on a connection kept for it, and
// whether its failures fail the CRI call.
type hookServer struct {
	client RuntimeHookServiceClient
	fail   bool
}

// hookServers maps a hook point ("PreCreateContainer") to the server called there.
type hookServers map[string]*hookServer

// loadHookServers reads DIR/*.json. Like koord-runtime-proxy, one server is called per hook
// point (the first file by name here; koord-runtime-proxy's pick is a Go map's order).
func loadHookServers(dir string) (hookServers, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	names := []string{}
	for _, entry := range entries {
		if !entry.IsDir() && strings.HasSuffix(entry.Name(), ".json") && !strings.HasPrefix(entry.Name(), ".") {
			names = append(names, entry.Name())
		}
	}
	sort.Strings(names)
	servers := hookServers{}
	for _, name := range names {
		content, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			return nil, err
		}
		var file struct {
			RemoteEndpoint string   `json:"remote-endpoint"`
			FailurePolicy  string   `json:"failure-policy"`
			RuntimeHooks   []string `json:"runtime-hooks"`
		}
		if err := json.Unmarshal(content, &file); err != nil {
			return nil, fmt.Errorf("%s: %v", name, err)
		}
		endpoint := strings.TrimPrefix(file.RemoteEndpoint, "unix://")
		if endpoint == "" {
			return nil, fmt.Errorf("%s: no remote-endpoint", name)
		}
		conn, err := dialUnix(endpoint)
		if err != nil {
			return nil, fmt.Errorf("%s: %v", name, err)
		}
		server := &hookServer{client: NewRuntimeHookServiceClient(conn), fail: file.FailurePolicy == "Fail"}
		for _, point := range file.RuntimeHooks {
			if _, taken := servers[point]; !taken {
				servers[point] = server
			}
		}
	}
	return servers, nil
}
