// Command krproxy-gohookserver is a hook server written with grpc-go, making the change the SDK
// benchmark plugin makes (krproxy/bench/sdk.py's register: one environment variable, BENCH, set
// to the pod's name, on PreCreateContainer): the benchmark's anchor for what a Go hook server
// costs per call (python -m krproxy.bench --only-hook-anchor).
//
// Its answer is what the SDK answers for that plugin: the request's container annotations,
// resources and pod cgroup parent echoed, and the request's environment with BENCH added (a
// non-nil container_envs replaces the whole environment in koord-runtime-proxy's merge, so a
// hook server that adds one variable sends them all).
//
// Once it listens it writes its registration file, NAME.json in the hook directory, as koordlet
// does (remote-endpoint, failure-policy Ignore, runtime-hooks PreCreateContainer), and removes it
// when it stops.
//
// runtime_hook_v1alpha1.pb.go and runtime_hook_v1alpha1_grpc.pb.go are generated from
// protos/runtime_hook_v1alpha1.proto by Debian's protoc-gen-go 1.36.5 and protoc-gen-go-grpc
// (grpc-go 1.64), package main:
//
//	python -m grpc_tools.protoc -I protos --go_out=DIR --go-grpc_out=DIR \
//	    --go_opt=paths=source_relative,Mruntime_hook_v1alpha1.proto='krproxy/hookapi;main' \
//	    --go-grpc_opt=paths=source_relative,Mruntime_hook_v1alpha1.proto='krproxy/hookapi;main' \
//	    runtime_hook_v1alpha1.proto
//
// tests/gohookproxy links to both files.
//
// Usage: krproxy-gohookserver -socket PATH -hook-dir DIR [-name NAME]. SIGTERM or SIGINT stops
// it gracefully; the exit status is 0 then, 2 on bad flags and 1 when it cannot listen or
// register.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"google.golang.org/grpc"
)

type hookServer struct {
	UnimplementedRuntimeHookServiceServer
}

// PreCreateContainerHook answers with the request's state and BENCH=<pod name> added.
func (hookServer) PreCreateContainerHook(
	_ context.Context, req *ContainerResourceHookRequest,
) (*ContainerResourceHookResponse, error) {
	envs := make(map[string]string, len(req.GetContainerEnvs())+1)
	for key, value := range req.GetContainerEnvs() {
		envs[key] = value
	}
	envs["BENCH"] = req.GetPodMeta().GetName()
	return &ContainerResourceHookResponse{
		ContainerAnnotations: req.GetContainerAnnotations(),
		ContainerResources:   req.GetContainerResources(),
		PodCgroupParent:      req.GetPodCgroupParent(),
		ContainerEnvs:        envs,
	}, nil
}

// register writes DIR/NAME.json through a hidden temp file, so that a directory scan never
// reads it half-written; it returns the file's path.
func register(dir, name, socket string) (string, error) {
	content, err := json.Marshal(struct {
		RemoteEndpoint string   `json:"remote-endpoint"`
		FailurePolicy  string   `json:"failure-policy"`
		RuntimeHooks   []string `json:"runtime-hooks"`
	}{socket, "Ignore", []string{"PreCreateContainer"}})
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	path := filepath.Join(dir, name+".json")
	temp := filepath.Join(dir, "."+name+".json.tmp")
	if err := os.WriteFile(temp, content, 0o644); err != nil {
		return "", err
	}
	return path, os.Rename(temp, path)
}

func main() {
	socket := flag.String("socket", "", "unix socket to serve (a stale file is replaced)")
	hookDir := flag.String("hook-dir", "", "the proxy's hook directory, where NAME.json goes")
	name := flag.String("name", "gohookserver", "the registration file's name, without .json")
	flag.Parse()
	if *socket == "" || *hookDir == "" || *name == "" || flag.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "usage: krproxy-gohookserver -socket PATH -hook-dir DIR [-name NAME]")
		os.Exit(2)
	}
	absolute, err := filepath.Abs(*socket)
	if err == nil {
		_ = os.Remove(absolute)
	}
	var listener net.Listener
	if err == nil {
		listener, err = net.Listen("unix", absolute)
	}
	var registration string
	if err == nil {
		registration, err = register(*hookDir, *name, absolute)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "krproxy-gohookserver: %v\n", err)
		os.Exit(1)
	}
	defer os.Remove(registration)
	server := grpc.NewServer()
	RegisterRuntimeHookServiceServer(server, hookServer{})
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-signals
		server.GracefulStop()
	}()
	if err := server.Serve(listener); err != nil {
		fmt.Fprintf(os.Stderr, "krproxy-gohookserver: %v\n", err)
		os.Remove(registration)
		os.Exit(1)
	}
}
