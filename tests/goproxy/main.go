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
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

const maxMsgSize = 16 * 1024 * 1024

// rawCodec (codec.go, a link to tests/goclient/codec.go) passes []byte through, so no message
// is decoded on the way.

type proxy struct {
	runtime *grpc.ClientConn
}

// outgoing is the caller's metadata less what grpc-go writes itself on the next hop.
func outgoing(in metadata.MD) metadata.MD {
	out := metadata.MD{}
	for key, values := range in {
		if strings.HasPrefix(key, ":") || key == "content-type" || key == "user-agent" || key == "te" {
			continue
		}
		out[key] = values
	}
	return out
}

// forward relays one call: requests to the runtime in a goroutine, answers back in this one.
func (p *proxy) forward(_ any, caller grpc.ServerStream) error {
	method, ok := grpc.MethodFromServerStream(caller)
	if !ok {
		return status.Error(codes.Internal, "no method name on the stream")
	}
	md, _ := metadata.FromIncomingContext(caller.Context())
	ctx, cancel := context.WithCancel(metadata.NewOutgoingContext(caller.Context(), outgoing(md)))
	defer cancel()
	desc := &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}
	upstream, err := p.runtime.NewStream(ctx, desc, method)
	if err != nil {
		return err
	}
	go func() {
		for {
			var message []byte
			if err := caller.RecvMsg(&message); err != nil {
				if errors.Is(err, io.EOF) {
					_ = upstream.CloseSend()
				} else {
					cancel() // the caller went away: so does the runtime's stream
				}
				return
			}
			if err := upstream.SendMsg(&message); err != nil {
				return // the answer side sees the error and ends the call with it
			}
		}
	}()
	headerSent := false
	for {
		var message []byte
		err := upstream.RecvMsg(&message)
		if !headerSent {
			headerSent = true
			if header, herr := upstream.Header(); herr == nil && len(header) > 0 {
				if serr := caller.SendHeader(header); serr != nil {
					return serr
				}
			}
		}
		if err != nil {
			caller.SetTrailer(upstream.Trailer())
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err // a status error keeps its code, message and details
		}
		if err := caller.SendMsg(&message); err != nil {
			return err
		}
	}
}

func main() {
	listen := flag.String("listen", "", "unix socket to serve (a stale file is replaced)")
	backend := flag.String("backend", "", "the runtime's unix socket")
	flag.Parse()
	if *listen == "" || *backend == "" || flag.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "usage: krproxy-goproxy -listen PATH -backend PATH")
		os.Exit(2)
	}
	dialer := func(ctx context.Context, addr string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", addr)
	}
	runtime, err := grpc.Dial(*backend,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithAuthority("localhost"),
		grpc.WithContextDialer(dialer),
		grpc.WithDefaultCallOptions(
			grpc.ForceCodec(rawCodec{}), grpc.MaxCallRecvMsgSize(maxMsgSize), grpc.MaxCallSendMsgSize(maxMsgSize)),
	)
	if err != nil {
		fmt.Fprintf(os.Stderr, "krproxy-goproxy: %v\n", err)
		os.Exit(1)
	}
	_ = os.Remove(*listen)
	listener, err := net.Listen("unix", *listen)
	if err != nil {
		fmt.Fprintf(os.Stderr, "krproxy-goproxy: %v\n", err)
		os.Exit(1)
	}
	p := &proxy{runtime: runtime}
	server := grpc.NewServer(
		grpc.UnknownServiceHandler(p.forward),
		grpc.ForceServerCodec(rawCodec{}),
		grpc.MaxRecvMsgSize(maxMsgSize),
		grpc.MaxSendMsgSize(maxMsgSize),
	)
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-signals
		server.GracefulStop()
	}()
	if err := server.Serve(listener); err != nil {
		fmt.Fprintf(os.Stderr, "krproxy-goproxy: %v\n", err)
		os.Exit(1)
	}
	_ = runtime.Close()
}
