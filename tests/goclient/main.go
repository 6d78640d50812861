// Command krproxy-goclient calls a CRI endpoint the way kubelet does, with grpc-go.
//
// kubelet is a grpc-go client (k8s.io/cri-client's remote runtime service). krproxy's tests
// otherwise call it from Python (grpcio, krproxy.rpc) and nghttp2's h2load, whose HTTP/2 stacks
// behave differently: grpc-go sends BDP-estimation PINGs and grows its windows as it measures,
// refuses an answer over its receive limit itself, and after a GOAWAY or a lost connection
// reconnects with backoff and replays only the calls the server said it never processed.
//
// The connection is set up with kubelet's options: insecure credentials, authority
// "localhost", a unix-socket context dialer, a 16 MiB receive limit on every call, and
// connection backoff from 100 ms to 3 s with a 5 s minimum connect timeout. Calls carry
// kubelet's deadlines (2 min, 4 min for RunPodSandbox) unless -timeout says otherwise, and
// are not wait-for-ready (kubelet's calls fail fast while the connection is down).
//
// Messages are raw bytes (a codec that passes []byte through), so no generated CRI code is
// needed: the test writes the request's protobuf encoding, and can decode what comes back.
//
// Modes:
//
//	-mode=calls   -calls N -concurrency C: N calls of -method, C at a time
//	-mode=steady  -duration S -concurrency C: calls back to back for S seconds, or until
//	              SIGTERM/SIGINT (then the calls in flight finish and the summary is printed)
//
// Either way one JSON line on stdout sums up: calls, status codes, a few messages per code,
// latencies and answer sizes. The exit status is 0 when the client ran (whatever the calls
// answered) and 2 on bad flags or an unreadable request.
package main

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// kubelet's constants (k8s.io/cri-client/pkg: remote_runtime.go and util).
const (
	kubeletMaxMsgSize     = 16 * 1024 * 1024 // maxMsgSize: the receive limit of every CRI call
	kubeletTimeout        = 2 * time.Minute  // the runtime request timeout's default
	kubeletBaseBackoff    = 100 * time.Millisecond
	kubeletMaxBackoff     = 3 * time.Second
	kubeletConnectTimeout = 5 * time.Second // minConnectionTimeout
)

type outcome struct {
	code    codes.Code
	message string
	latency time.Duration
	size    int
}

type summary struct {
	Mode        string              `json:"mode"`
	Method      string              `json:"method"`
	Timeout     string              `json:"timeout"`
	Calls       int                 `json:"calls"`
	Codes       map[string]int      `json:"codes"`
	Messages    map[string][]string `json:"messages"`
	LatencyMs   map[string]float64  `json:"latency_ms"`
	AnswerBytes map[string]int      `json:"answer_bytes"`
	Seconds     float64             `json:"seconds"`
}

func kubeletDeadline(method string) time.Duration {
	if strings.HasSuffix(method, "/RunPodSandbox") {
		return 2 * kubeletTimeout // "2 times longer timeout for sandbox operation"
	}
	return kubeletTimeout
}

// dial connects as k8s.io/cri-client's NewRemoteRuntimeService does.
func dial(ctx context.Context, socket string, maxRecv, maxSend int, connectTimeout time.Duration) (*grpc.ClientConn, error) {
	dialer := func(ctx context.Context, addr string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", addr)
	}
	params := grpc.ConnectParams{Backoff: backoff.DefaultConfig, MinConnectTimeout: connectTimeout}
	params.Backoff.BaseDelay = kubeletBaseBackoff
	params.Backoff.MaxDelay = kubeletMaxBackoff
	callOptions := []grpc.CallOption{grpc.MaxCallRecvMsgSize(maxRecv), grpc.ForceCodec(rawCodec{})}
	if maxSend > 0 {
		callOptions = append(callOptions, grpc.MaxCallSendMsgSize(maxSend))
	}
	return grpc.DialContext(ctx, socket,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithAuthority("localhost"),
		grpc.WithContextDialer(dialer),
		grpc.WithDefaultCallOptions(callOptions...),
		grpc.WithConnectParams(params),
	)
}

func call(conn *grpc.ClientConn, method string, request []byte, timeout time.Duration, saveTo string) outcome {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	var answer []byte
	started := time.Now()
	err := conn.Invoke(ctx, method, &request, &answer)
	got := outcome{code: status.Code(err), latency: time.Since(started), size: len(answer)}
	if err != nil {
		got.message = status.Convert(err).Message()
	} else if saveTo != "" {
		if werr := os.WriteFile(saveTo, answer, 0o644); werr != nil {
			got.code, got.message = codes.Unknown, "saving the answer: "+werr.Error()
		}
	}
	return got
}

func percentile(sorted []time.Duration, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := int(float64(len(sorted)-1) * p)
	return float64(sorted[i].Microseconds()) / 1000
}

func summarise(mode, method string, timeout time.Duration, outcomes []outcome, elapsed time.Duration) summary {
	s := summary{
		Mode: mode, Method: method, Timeout: timeout.String(), Calls: len(outcomes),
		Codes: map[string]int{}, Messages: map[string][]string{}, Seconds: elapsed.Seconds(),
	}
	latencies := make([]time.Duration, 0, len(outcomes))
	minSize, maxSize := -1, 0
	for _, o := range outcomes {
		name := codeName(o.code)
		s.Codes[name]++
		if o.message != "" && len(s.Messages[name]) < 3 && !contains(s.Messages[name], o.message) {
			s.Messages[name] = append(s.Messages[name], o.message)
		}
		latencies = append(latencies, o.latency)
		if o.code == codes.OK {
			if minSize < 0 || o.size < minSize {
				minSize = o.size
			}
			if o.size > maxSize {
				maxSize = o.size
			}
		}
	}
	sort.Slice(latencies, func(i, j int) bool { return latencies[i] < latencies[j] })
	s.LatencyMs = map[string]float64{
		"min": percentile(latencies, 0), "p50": percentile(latencies, 0.5),
		"p99": percentile(latencies, 0.99), "max": percentile(latencies, 1),
	}
	if minSize < 0 {
		minSize = 0
	}
	s.AnswerBytes = map[string]int{"min": minSize, "max": maxSize}
	return s
}

// codeName is the status code's canonical name (UNAVAILABLE), as gRPC's spec and grpcio spell it;
// grpc-go's String() says Unavailable.
func codeName(c codes.Code) string {
	names := map[codes.Code]string{
		codes.OK: "OK", codes.Canceled: "CANCELLED", codes.Unknown: "UNKNOWN",
		codes.InvalidArgument: "INVALID_ARGUMENT", codes.DeadlineExceeded: "DEADLINE_EXCEEDED",
		codes.NotFound: "NOT_FOUND", codes.AlreadyExists: "ALREADY_EXISTS",
		codes.PermissionDenied: "PERMISSION_DENIED", codes.ResourceExhausted: "RESOURCE_EXHAUSTED",
		codes.FailedPrecondition: "FAILED_PRECONDITION", codes.Aborted: "ABORTED",
		codes.OutOfRange: "OUT_OF_RANGE", codes.Unimplemented: "UNIMPLEMENTED", codes.Internal: "INTERNAL",
		codes.Unavailable: "UNAVAILABLE", codes.DataLoss: "DATA_LOSS", codes.Unauthenticated: "UNAUTHENTICATED",
	}
	if name, ok := names[c]; ok {
		return name
	}
	return fmt.Sprintf("CODE_%d", uint32(c))
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "krproxy-goclient: "+format+"\n", args...)
	os.Exit(2)
}

func main() {
	socket := flag.String("socket", "", "the CRI endpoint's unix socket path (unix:// prefix optional)")
	mode := flag.String("mode", "calls", "calls (N calls) or steady (calls for -duration)")
	method := flag.String("method", "/runtime.v1.RuntimeService/Version", "the full gRPC method name")
	requestHex := flag.String("request-hex", "", "the request message, protobuf bytes in hex (default: empty message)")
	requestFile := flag.String("request-file", "", "a file holding the request message's protobuf bytes")
	calls := flag.Int("calls", 1, "calls mode: how many calls")
	concurrency := flag.Int("concurrency", 1, "how many calls at a time")
	duration := flag.Duration("duration", 5*time.Second, "steady mode: how long to keep calling")
	timeout := flag.Duration("timeout", 0, "each call's deadline (default kubelet's: 2m, 4m for RunPodSandbox)")
	maxRecv := flag.Int("max-recv", kubeletMaxMsgSize, "the receive limit of each call, bytes (kubelet: 16 MiB)")
	maxSend := flag.Int("max-send", 0, "the send limit of each call, bytes (default: grpc-go's, as kubelet)")
	saveAnswer := flag.String("save-answer", "", "write the last successful answer's bytes to this file")
	answeredFile := flag.String("answered-file", "", "create this file when a call answers OK and the file is missing")
	connectTimeout := flag.Duration("connect-timeout", kubeletConnectTimeout,
		"how long a connection attempt may wait for the server's SETTINGS (kubelet: 5s)")
	flag.Parse()

	if *socket == "" {
		fail("-socket is required (the unix socket to call, e.g. /run/krproxy/krproxy.sock)")
	}
	if *mode != "calls" && *mode != "steady" {
		fail("-mode must be calls or steady, not %q", *mode)
	}
	if *calls < 1 || *concurrency < 1 {
		fail("-calls and -concurrency must be at least 1")
	}
	if !strings.HasPrefix(*method, "/") || strings.Count(*method, "/") != 2 {
		fail("-method must be /package.Service/Method, not %q", *method)
	}
	var request []byte
	switch {
	case *requestHex != "" && *requestFile != "":
		fail("give -request-hex or -request-file, not both")
	case *requestHex != "":
		b, err := hex.DecodeString(*requestHex)
		if err != nil {
			fail("-request-hex is not hex: %v", err)
		}
		request = b
	case *requestFile != "":
		b, err := os.ReadFile(*requestFile)
		if err != nil {
			fail("-request-file: %v", err)
		}
		request = b
	}
	deadline := *timeout
	if deadline == 0 {
		deadline = kubeletDeadline(*method)
	}
	path := strings.TrimPrefix(*socket, "unix://")

	ctx, cancel := context.WithTimeout(context.Background(), kubeletTimeout)
	conn, err := dial(ctx, path, *maxRecv, *maxSend, *connectTimeout)
	cancel()
	if err != nil {
		fail("dial %s: %v", path, err)
	}
	defer conn.Close()

	var (
		mu       sync.Mutex
		outcomes []outcome
		issued   atomic.Int64
		wg       sync.WaitGroup
		stopped  atomic.Bool
	)
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-signals
		stopped.Store(true)
	}()
	started := time.Now()
	stopAt := started.Add(*duration)
	more := func() bool {
		if stopped.Load() {
			return false
		}
		if *mode == "steady" {
			return time.Now().Before(stopAt)
		}
		return issued.Add(1) <= int64(*calls)
	}
	for w := 0; w < *concurrency; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for more() {
				o := call(conn, *method, request, deadline, *saveAnswer)
				mu.Lock()
				outcomes = append(outcomes, o)
				mu.Unlock()
				if *answeredFile != "" && o.code == codes.OK {
					if _, err := os.Stat(*answeredFile); os.IsNotExist(err) {
						_ = os.WriteFile(*answeredFile, nil, 0o644)
					}
				}
			}
		}()
	}
	wg.Wait()
	out, _ := json.Marshal(summarise(*mode, *method, deadline, outcomes, time.Since(started)))
	fmt.Println(string(out))
}
