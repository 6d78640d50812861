package main

// The intercepted CRI calls: request → hook request → hook server → merge → runtime → store.
// Field by field what koord-runtime-proxy does (shared/notes/hook-semantics.md, 2.3 and 2.4).

import (
	"context"
	"fmt"
	"log"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

const (
	runPodSandbox   = "/runtime.v1.RuntimeService/RunPodSandbox"
	createContainer = "/runtime.v1.RuntimeService/CreateContainer"
)

type hookProxy struct {
	raw   *proxy
	hooks hookServers
	// pods and containers: what koord-runtime-proxy's store keeps, by sandbox and container id.
	mu         sync.RWMutex
	pods       map[string]*PodSandboxHookRequest
	containers map[string]*ContainerResourceHookRequest
}

func newHookProxy(raw *proxy, hooks hookServers) *hookProxy {
	return &hookProxy{
		raw:        raw,
		hooks:      hooks,
		pods:       map[string]*PodSandboxHookRequest{},
		containers: map[string]*ContainerResourceHookRequest{},
	}
}

// handle serves one call: RunPodSandbox and CreateContainer intercepted, the rest raw.
func (h *hookProxy) handle(srv any, caller grpc.ServerStream) error {
	method, _ := grpc.MethodFromServerStream(caller)
	var intercept func(context.Context, []byte) ([]byte, error)
	switch method {
	case runPodSandbox:
		intercept = h.runPodSandbox
	case createContainer:
		intercept = h.createContainer
	default:
		return h.raw.forward(srv, caller)
	}
	var request []byte
	if err := caller.RecvMsg(&request); err != nil {
		return err
	}
	md, _ := metadata.FromIncomingContext(caller.Context())
	answer, err := intercept(metadata.NewOutgoingContext(caller.Context(), outgoing(md)), request)
	if err != nil {
		return err
	}
	return caller.SendMsg(&answer)
}

// preHook calls the server registered for point; false when the call is to go on unchanged
// (no server, or a failure it may ignore), an error when it must fail.
func (h *hookProxy) preHook(point string, call func(RuntimeHookServiceClient) error) (bool, error) {
	server := h.hooks[point]
	if server == nil {
		return false, nil
	}
	if err := call(server.client); err != nil {
		if server.fail {
			return false, fmt.Errorf("hook server err: %v", err)
		}
		log.Printf("%s hook failed, ignored: %v", point, err)
		return false, nil
	}
	return true, nil
}

// invoke sends the re-encoded request to the runtime and returns its answer's bytes.
func (h *hookProxy) invoke(ctx context.Context, method string, request []byte) ([]byte, error) {
	var answer []byte
	if err := h.raw.runtime.Invoke(ctx, method, &request, &answer); err != nil {
		return nil, err
	}
	return answer, nil
}

func badRequest(err error) error {
	return status.Errorf(codes.InvalidArgument, "cannot decode the request: %v", err)
}

func (h *hookProxy) runPodSandbox(ctx context.Context, body []byte) ([]byte, error) {
	req := &runtimeapi.RunPodSandboxRequest{}
	if err := req.Unmarshal(body); err != nil {
		return nil, badRequest(err)
	}
	config := req.GetConfig()
	pod := &PodSandboxHookRequest{
		PodMeta: &PodSandboxMetadata{
			Name:      config.GetMetadata().GetName(),
			Uid:       config.GetMetadata().GetUid(),
			Namespace: config.GetMetadata().GetNamespace(),
		},
		RuntimeHandler: req.GetRuntimeHandler(),
		Labels:         config.GetLabels(),
		Annotations:    config.GetAnnotations(),
		CgroupParent:   config.GetLinux().GetCgroupParent(),
	}
	var resp *PodSandboxHookResponse
	changed, err := h.preHook("PreRunPodSandbox", func(c RuntimeHookServiceClient) (err error) {
		resp, err = c.PreRunPodSandboxHook(ctx, pod)
		return err
	})
	if err != nil {
		return nil, err
	}
	if changed && resp != nil && config != nil {
		pod.Annotations = mergeMap(pod.Annotations, resp.GetAnnotations())
		pod.Labels = mergeMap(pod.Labels, resp.GetLabels())
		config.Annotations, config.Labels = pod.Annotations, pod.Labels
		if resp.GetCgroupParent() != "" && config.Linux != nil {
			pod.CgroupParent = resp.GetCgroupParent()
			config.Linux.CgroupParent = pod.CgroupParent
		}
	}
	body, err = req.Marshal()
	if err != nil {
		return nil, err
	}
	answer, err := h.invoke(ctx, runPodSandbox, body)
	if err != nil {
		return nil, err
	}
	done := &runtimeapi.RunPodSandboxResponse{}
	if err := done.Unmarshal(answer); err != nil {
		return nil, err
	}
	h.mu.Lock()
	h.pods[done.GetPodSandboxId()] = pod
	h.mu.Unlock()
	return done.Marshal()
}

func (h *hookProxy) createContainer(ctx context.Context, body []byte) ([]byte, error) {
	req := &runtimeapi.CreateContainerRequest{}
	if err := req.Unmarshal(body); err != nil {
		return nil, badRequest(err)
	}
	h.mu.RLock()
	pod := h.pods[req.GetPodSandboxId()]
	h.mu.RUnlock()
	config := req.GetConfig()
	var container *ContainerResourceHookRequest
	if pod == nil {
		log.Printf("pod %q not in the store: no hooks", req.GetPodSandboxId())
	} else {
		container = &ContainerResourceHookRequest{
			PodMeta: pod.PodMeta,
			ContainerMeta: &ContainerMetadata{
				Name:    config.GetMetadata().GetName(),
				Attempt: config.GetMetadata().GetAttempt(),
			},
			ContainerAnnotations: config.GetAnnotations(),
			ContainerResources:   hookResources(config.GetLinux().GetResources()),
			PodAnnotations:       pod.Annotations,
			PodLabels:            pod.Labels,
			PodCgroupParent:      req.GetSandboxConfig().GetLinux().GetCgroupParent(),
			ContainerEnvs:        envMap(config.GetEnvs()),
		}
		var resp *ContainerResourceHookResponse
		changed, err := h.preHook("PreCreateContainer", func(c RuntimeHookServiceClient) (err error) {
			resp, err = c.PreCreateContainerHook(ctx, container)
			return err
		})
		if err != nil {
			return nil, err
		}
		if changed && resp != nil && config != nil {
			mergeContainer(req, container, resp)
		}
	}
	body, err := req.Marshal()
	if err != nil {
		return nil, err
	}
	answer, err := h.invoke(ctx, createContainer, body)
	if err != nil {
		return nil, err
	}
	done := &runtimeapi.CreateContainerResponse{}
	if err := done.Unmarshal(answer); err != nil {
		return nil, err
	}
	if container != nil {
		container.ContainerMeta.Id = done.GetContainerId()
		h.mu.Lock()
		h.containers[done.GetContainerId()] = container
		h.mu.Unlock()
	}
	return done.Marshal()
}

// mergeContainer applies a PreCreateContainer answer to the request (and to the hook request
// kept in the store), as koord-runtime-proxy's container UpdateRequest does.
func mergeContainer(req *runtimeapi.CreateContainerRequest, info *ContainerResourceHookRequest,
	resp *ContainerResourceHookResponse) {
	config := req.Config
	info.ContainerAnnotations = mergeMap(info.ContainerAnnotations, resp.GetContainerAnnotations())
	config.Annotations = info.ContainerAnnotations
	if resp.ContainerResources != nil {
		updateResources(info.ContainerResources, resp.ContainerResources)
		if config.Linux == nil {
			config.Linux = &runtimeapi.LinuxContainerConfig{}
		}
		config.Linux.Resources = criResources(info.ContainerResources)
	}
	if resp.GetPodCgroupParent() != "" && req.SandboxConfig != nil && req.SandboxConfig.Linux != nil {
		info.PodCgroupParent = resp.GetPodCgroupParent()
		req.SandboxConfig.Linux.CgroupParent = info.PodCgroupParent
	}
	if resp.ContainerEnvs != nil {
		info.ContainerEnvs = resp.ContainerEnvs
	}
	// Always rebuilt from the map (so in a Go map's order), as koord-runtime-proxy does.
	envs := make([]*runtimeapi.KeyValue, 0, len(info.ContainerEnvs))
	for key, value := range info.ContainerEnvs {
		envs = append(envs, &runtimeapi.KeyValue{Key: key, Value: value})
	}
	config.Envs = envs
}

// updateResources merges b into a field by field: koord-runtime-proxy's updateResource.
func updateResources(a, b *LinuxContainerResources) {
	if b.CpuPeriod > 0 {
		a.CpuPeriod = b.CpuPeriod
	}
	if b.CpuQuota != 0 {
		a.CpuQuota = b.CpuQuota
	}
	if b.CpuShares > 0 {
		a.CpuShares = b.CpuShares
	}
	if b.MemoryLimitInBytes > 0 {
		a.MemoryLimitInBytes = b.MemoryLimitInBytes
	}
	if b.OomScoreAdj >= -1000 && b.OomScoreAdj <= 1000 {
		a.OomScoreAdj = b.OomScoreAdj
	}
	a.CpusetCpus, a.CpusetMems = b.CpusetCpus, b.CpusetMems
	a.Unified = mergeMap(a.Unified, b.Unified)
	if b.MemorySwapLimitInBytes > 0 {
		a.MemorySwapLimitInBytes = b.MemorySwapLimitInBytes
	}
}

// mergeMap adds and overwrites b's keys in a copy of a.
func mergeMap(a, b map[string]string) map[string]string {
	if a == nil && b == nil {
		return nil
	}
	out := make(map[string]string, len(a)+len(b))
	for key, value := range a {
		out[key] = value
	}
	for key, value := range b {
		out[key] = value
	}
	return out
}

// envMap is the environment as a map; a later value of a key wins.
func envMap(envs []*runtimeapi.KeyValue) map[string]string {
	out := make(map[string]string, len(envs))
	for _, kv := range envs {
		out[kv.GetKey()] = kv.GetValue()
	}
	return out
}

// hookResources is r in the hook protocol's type: never nil, as koord-runtime-proxy's.
func hookResources(r *runtimeapi.LinuxContainerResources) *LinuxContainerResources {
	out := &LinuxContainerResources{}
	if r == nil {
		return out
	}
	out.CpuPeriod, out.CpuQuota, out.CpuShares = r.CpuPeriod, r.CpuQuota, r.CpuShares
	out.MemoryLimitInBytes, out.OomScoreAdj = r.MemoryLimitInBytes, r.OomScoreAdj
	out.CpusetCpus, out.CpusetMems = r.CpusetCpus, r.CpusetMems
	out.Unified, out.MemorySwapLimitInBytes = r.Unified, r.MemorySwapLimitInBytes
	for _, limit := range r.HugepageLimits {
		out.HugepageLimits = append(out.HugepageLimits, &HugepageLimit{PageSize: limit.PageSize, Limit: limit.Limit})
	}
	return out
}

// criResources is r in the CRI type.
func criResources(r *LinuxContainerResources) *runtimeapi.LinuxContainerResources {
	out := &runtimeapi.LinuxContainerResources{
		CpuPeriod: r.CpuPeriod, CpuQuota: r.CpuQuota, CpuShares: r.CpuShares,
		MemoryLimitInBytes: r.MemoryLimitInBytes, OomScoreAdj: r.OomScoreAdj,
		CpusetCpus: r.CpusetCpus, CpusetMems: r.CpusetMems,
		Unified: r.Unified, MemorySwapLimitInBytes: r.MemorySwapLimitInBytes,
	}
	for _, limit := range r.HugepageLimits {
		out.HugepageLimits = append(out.HugepageLimits,
			&runtimeapi.HugepageLimit{PageSize: limit.PageSize, Limit: limit.Limit})
	}
	return out
}
