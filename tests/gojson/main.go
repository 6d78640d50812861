// Command krproxy-gojson reads JSON files the way the Go programs beside krproxy read them, with
// encoding/json's Unmarshal into their structs (the same field names, tags and types), and prints,
// for each file named after the flags, one JSON line: {"value": ...} with the struct's fields as Go
// holds them (nothing omitted: "" and nil show), or {"error": "..."} when Unmarshal refuses it.
//
//	-as registration      koord-runtime-proxy's RuntimeHookConfig (pkg/runtimeproxy/config): a
//	                      hookserver.d registration file
//	-as resource-status   Koordinator's ResourceStatus (apis/extension): the value of the pod
//	                      annotation scheduling.koordinator.sh/resource-status, as koordlet reads it
//
// Keys match the fields as Go matches them (case-insensitively, by Unicode simple folding; the last
// of several wins), which is what the tests compare krproxy's readings with. Exit 0 once every file
// is printed, 2 on bad flags or an unreadable file.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"os"
)

type failurePolicyType string

type runtimeHookType string

// runtimeHookConfig is koord-runtime-proxy's RuntimeHookConfig.
type runtimeHookConfig struct {
	RemoteEndpoint string            `json:"remote-endpoint,omitempty"`
	FailurePolicy  failurePolicyType `json:"failure-policy,omitempty"`
	RuntimeHooks   []runtimeHookType `json:"runtime-hooks,omitempty"`
}

// cpuSharedPool and resourceStatus are Koordinator's CPUSharedPool and ResourceStatus.
type cpuSharedPool struct {
	Socket int32 `json:"socket"`
	Node   int32 `json:"node"`
}

type resourceStatus struct {
	CPUSet         string          `json:"cpuset,omitempty"`
	CPUSharedPools []cpuSharedPool `json:"cpuSharedPools,omitempty"`
}

func read(as string, data []byte) (any, error) {
	switch as {
	case "registration":
		config := &runtimeHookConfig{}
		if err := json.Unmarshal(data, config); err != nil {
			return nil, err
		}
		return map[string]any{
			"remote-endpoint": config.RemoteEndpoint,
			"failure-policy":  config.FailurePolicy,
			"runtime-hooks":   config.RuntimeHooks,
		}, nil
	case "resource-status":
		status := &resourceStatus{}
		if err := json.Unmarshal(data, status); err != nil {
			return nil, err
		}
		return map[string]any{"cpuset": status.CPUSet, "cpuSharedPools": status.CPUSharedPools}, nil
	}
	fmt.Fprintf(os.Stderr, "krproxy-gojson: -as %q: not registration or resource-status\n", as)
	os.Exit(2)
	return nil, nil
}

func main() {
	as := flag.String("as", "registration", "the struct the files are read into")
	flag.Parse()
	out := json.NewEncoder(os.Stdout)
	for _, path := range flag.Args() {
		data, err := os.ReadFile(path)
		if err != nil {
			fmt.Fprintf(os.Stderr, "krproxy-gojson: %v\n", err)
			os.Exit(2)
		}
		value, err := read(*as, data)
		if err != nil {
			_ = out.Encode(map[string]string{"error": err.Error()})
			continue
		}
		_ = out.Encode(map[string]any{"value": value})
	}
}
