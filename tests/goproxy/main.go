// Command krproxy-goproxy forwards every gRPC call it receives on one unix socket to another, as
// raw bytes, with grpc-go: the benchmark's anchor for what a Go proxy costs.
//
// koord-runtime-proxy and most CRI proxies written in Go pass calls they do not intercept
// through grpc-go this way: a server whose unknown-service handler takes every method, a codec
// that hands message bytes over without decoding them, and one client connection to the runtime
// on which each call is opened as a stream of the same method. krproxy's benchmark
// (python -m krproxy.bench --only-go-anchor) runs this program and krproxy in front of the same
// containerd and prints both figures side by side.
//
// What is forwarded: the method, the caller's metadata (grpc-go sets content-type, user-agent
// and the pseudo-headers itself), its deadline (through the context), every request and answer
// message in order, the runtime's header and trailer metadata, and its status (code, message,
// details). Message limits are kubelet's and containerd's: 16 MiB each way.
//
// Usage: krproxy-goproxy -listen PATH -backend PATH. SIGTERM or SIGINT stops it gracefully
// (calls in flight finish); the exit status is 0 then, 2 on bad flags and 1 when it cannot listen.
package main

import (
	"flag"
	"fmt"
	"os"
)

func main() {
	listen := flag.String("listen", "", "unix socket to serve (a stale file is replaced)")
	backend := flag.String("backend", "", "the runtime's unix socket")
	flag.Parse()
	if *listen == "" || *backend == "" || flag.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "usage: krproxy-goproxy -listen PATH -backend PATH")
		os.Exit(2)
	}
	runtime, err := dialRuntime(*backend)
	if err != nil {
		fmt.Fprintf(os.Stderr, "krproxy-goproxy: %v\n", err)
		os.Exit(1)
	}
	p := &proxy{runtime: runtime}
	if err := serve(*listen, p.forward); err != nil {
		fmt.Fprintf(os.Stderr, "krproxy-goproxy: %v\n", err)
		os.Exit(1)
	}
	_ = runtime.Close()
}
