// Command krproxy-goregistration reads hook server registration files the way koord-runtime-proxy
// does (encoding/json's Unmarshal into its RuntimeHookConfig: the same field names, tags and types)
// and prints, for each file named on the command line, one JSON line: {"config": ...} with the
// three fields as Go holds them (a nil list as null), or {"error": "..."} when Unmarshal refuses
// the file, which koord-runtime-proxy then skips. Keys match the fields as Go matches them
// (case-insensitively, by Unicode simple folding; the last of several wins), which is what the
// tests compare krproxy's reading with. Exit 0 once every file is printed, 2 on an unreadable one.
package main

import (
	"encoding/json"
	"fmt"
	"os"
)

type failurePolicyType string

type runtimeHookType string

// runtimeHookConfig is koord-runtime-proxy's RuntimeHookConfig (pkg/runtimeproxy/config).
type runtimeHookConfig struct {
	RemoteEndpoint string            `json:"remote-endpoint,omitempty"`
	FailurePolicy  failurePolicyType `json:"failure-policy,omitempty"`
	RuntimeHooks   []runtimeHookType `json:"runtime-hooks,omitempty"`
}

// read is what one file gave: its fields, without omitempty, so that "" and nil show.
type read struct {
	RemoteEndpoint string            `json:"remote-endpoint"`
	FailurePolicy  failurePolicyType `json:"failure-policy"`
	RuntimeHooks   []runtimeHookType `json:"runtime-hooks"`
}

func main() {
	out := json.NewEncoder(os.Stdout)
	for _, path := range os.Args[1:] {
		data, err := os.ReadFile(path)
		if err != nil {
			fmt.Fprintf(os.Stderr, "krproxy-goregistration: %v\n", err)
			os.Exit(2)
		}
		config := &runtimeHookConfig{}
		if err := json.Unmarshal(data, config); err != nil {
			_ = out.Encode(map[string]string{"error": err.Error()})
			continue
		}
		_ = out.Encode(map[string]read{"config": {config.RemoteEndpoint, config.FailurePolicy, config.RuntimeHooks}})
	}
}
