// Command gonristub is the bench's NRI plugin built on containerd's own Go stub (containerd/nri
// pkg/stub, Debian's golang-github-containerd-nri-dev 0.8.0): the same plugin as the Python one the
// bench runs with krproxy's NriStub (krproxy/bench/nri.py): it is told of each RunPodSandbox and adds
// one env var at each CreateContainer. It prints "synchronized" on stderr once the runtime has
// synchronized it, and exits when the runtime closes the connection or on SIGTERM.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/stub"
)

type plugin struct{}

func (p *plugin) Synchronize(ctx context.Context, pods []*api.PodSandbox, containers []*api.Container) ([]*api.ContainerUpdate, error) {
	fmt.Fprintf(os.Stderr, "synchronized: %d pods, %d containers\n", len(pods), len(containers))
	return nil, nil
}

func (p *plugin) RunPodSandbox(ctx context.Context, pod *api.PodSandbox) error {
	return nil
}

func (p *plugin) CreateContainer(ctx context.Context, pod *api.PodSandbox, ctr *api.Container) (*api.ContainerAdjustment, []*api.ContainerUpdate, error) {
	adjust := &api.ContainerAdjustment{}
	adjust.AddEnv("KRPROXY_BENCH_PLUGIN", "go")
	return adjust, nil, nil
}

func main() {
	socket := flag.String("socket", "/var/run/nri/nri.sock", "the runtime's NRI socket")
	name := flag.String("name", "bench-go", "plugin name")
	idx := flag.String("idx", "40", "plugin index")
	flag.Parse()

	s, err := stub.New(&plugin{}, stub.WithPluginName(*name), stub.WithPluginIdx(*idx), stub.WithSocketPath(*socket))
	if err != nil {
		fmt.Fprintf(os.Stderr, "gonristub: %v\n", err)
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if err := s.Start(ctx); err != nil {
		fmt.Fprintf(os.Stderr, "gonristub: %v\n", err)
		os.Exit(1)
	}
	done := make(chan struct{})
	go func() { s.Wait(); close(done) }()
	select {
	case <-ctx.Done():
		s.Stop()
	case <-done:
	}
}
