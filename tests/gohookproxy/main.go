// Command krproxy-gohookproxy is a CRI proxy written with grpc-go that does koord-runtime-proxy's
// work on a hooked call: the benchmark's anchor for what a hooked CreateContainer costs in Go
// (python -m krproxy.bench --only-hook-anchor runs it and krproxy in front of the same runtime).
//
// RunPodSandbox and CreateContainer are decoded with the CRI Go types (k8s.io/cri-api, gogo
// generated, as koord-runtime-proxy's), turned into the hook request koord-runtime-proxy builds
// (pod.go and container.go of its resexecutor/cri), sent to the one hook server registered for
// that hook point over one connection kept for it, merged as koord-runtime-proxy merges
// (cri.go), re-encoded and forwarded; the runtime's answer is decoded and the pod or container
// stored by its id, as koord-runtime-proxy's ResourceCheckPoint does (CreateContainer reads its
// pod from there). Every other call is forwarded as raw bytes (forward.go, tests/goproxy's).
//
// Hook servers are read once at start from the registration files (*.json) of -hook-dir, in the
// format koordlet writes; no directory watch. A hook failure with failure-policy Fail is the
// caller's error (code Unknown, "hook server err: ..."); otherwise the call goes on unchanged.
//
// Usage: krproxy-gohookproxy -listen PATH -backend PATH [-hook-dir DIR]. SIGTERM or SIGINT stops
// it gracefully; the exit status is 0 then, 2 on bad flags and 1 when it cannot listen or read
// the hook directory.
package main

import (
	"flag"
	"fmt"
	"os"
)

func main() {
	listen := flag.String("listen", "", "unix socket to serve (a stale file is replaced)")
	backend := flag.String("backend", "", "the runtime's unix socket")
	hookDir := flag.String("hook-dir", "", "directory of hook server registration files (none: no hooks)")
	flag.Parse()
	if *listen == "" || *backend == "" || flag.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "usage: krproxy-gohookproxy -listen PATH -backend PATH [-hook-dir DIR]")
		os.Exit(2)
	}
	hooks := hookServers{}
	if *hookDir != "" {
		var err error
		if hooks, err = loadHookServers(*hookDir); err != nil {
			fmt.Fprintf(os.Stderr, "krproxy-gohookproxy: %v\n", err)
			os.Exit(1)
		}
	}
	runtime, err := dialRuntime(*backend)
	if err != nil {
		fmt.Fprintf(os.Stderr, "krproxy-gohookproxy: %v\n", err)
		os.Exit(1)
	}
	p := newHookProxy(&proxy{runtime: runtime}, hooks)
	if err := serve(*listen, p.handle); err != nil {
		fmt.Fprintf(os.Stderr, "krproxy-gohookproxy: %v\n", err)
		os.Exit(1)
	}
	_ = runtime.Close()
}
