package main

// The raw-bytes codec of krproxy's Go test peers: tests/goclient has this file, and
// tests/goproxy links to it, so that both programs pass message bytes through the same way.

import (
	"fmt"

	"google.golang.org/grpc/encoding"
)

// rawCodec passes []byte through: requests are written and answers read as protobuf bytes.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) {
	b, ok := v.(*[]byte)
	if !ok {
		return nil, fmt.Errorf("rawCodec: cannot marshal %T", v)
	}
	return *b, nil
}

func (rawCodec) Unmarshal(data []byte, v any) error {
	b, ok := v.(*[]byte)
	if !ok {
		return fmt.Errorf("rawCodec: cannot unmarshal into %T", v)
	}
	*b = append((*b)[:0], data...)
	return nil
}

// Name is "proto" so that the content-type stays application/grpc, as kubelet sends it.
func (rawCodec) Name() string { return "proto" }

var _ encoding.Codec = rawCodec{}
