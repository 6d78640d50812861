package main

// The forwarding half of krproxy's Go proxies: tests/goproxy (everything raw) is this file and a
// main; tests/gohookproxy links to it and forwards every call it does not intercept the same way.

import (
	"context"
	"errors"
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

// dialUnix opens a client connection to the unix socket at path (connected on first use).
func dialUnix(path string, options ...grpc.DialOption) (*grpc.ClientConn, error) {
	dialer := func(ctx context.Context, addr string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", addr)
	}
	options = append([]grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithAuthority("localhost"),
		grpc.WithContextDialer(dialer),
	}, options...)
	return grpc.Dial(path, options...)
}

// dialRuntime is the one connection to the runtime, on which every call goes as raw bytes.
func dialRuntime(backend string) (*grpc.ClientConn, error) {
	return dialUnix(backend, grpc.WithDefaultCallOptions(
		grpc.ForceCodec(rawCodec{}), grpc.MaxCallRecvMsgSize(maxMsgSize), grpc.MaxCallSendMsgSize(maxMsgSize)))
}

// serve answers every call on the unix socket listen with handler (raw bytes, kubelet's
// limits) until SIGTERM or SIGINT, which stops it gracefully: calls in flight finish.
func serve(listen string, handler grpc.StreamHandler) error {
	_ = os.Remove(listen)
	listener, err := net.Listen("unix", listen)
	if err != nil {
		return err
	}
	server := grpc.NewServer(
		grpc.UnknownServiceHandler(handler),
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
	return server.Serve(listener)
}
