// Command krproxy-godecode reads one protobuf message the way a Go program does, with
// google.golang.org/protobuf, and prints it as JSON: what koord-runtime-proxy (Go) makes of the
// bytes krproxy's SDK answers, maps included (a key repeated on the wire keeps its last value).
//
// Usage: krproxy-godecode -descriptor FILE -message NAME < MESSAGE
//
// FILE holds a serialized FileDescriptorProto that imports nothing (krproxy's
// runtime_hook_v1alpha1.proto); NAME is a message's full name in it. The message's bytes come on
// stdin; stdout gets one JSON line (protojson, proto field names). Exit 0 when decoded, 1 when
// the bytes are no such message, 2 on bad flags or an unreadable descriptor.
package main

import (
	"flag"
	"fmt"
	"io"
	"os"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
)

func fail(code int, format string, args ...any) {
	fmt.Fprintf(os.Stderr, "krproxy-godecode: "+format+"\n", args...)
	os.Exit(code)
}

func main() {
	descriptor := flag.String("descriptor", "", "a serialized FileDescriptorProto")
	name := flag.String("message", "", "the full name of the message on stdin")
	flag.Parse()
	if *descriptor == "" || *name == "" || flag.NArg() != 0 {
		fail(2, "usage: krproxy-godecode -descriptor FILE -message NAME < MESSAGE")
	}
	raw, err := os.ReadFile(*descriptor)
	if err != nil {
		fail(2, "%v", err)
	}
	var file descriptorpb.FileDescriptorProto
	if err := proto.Unmarshal(raw, &file); err != nil {
		fail(2, "%s is no FileDescriptorProto: %v", *descriptor, err)
	}
	fd, err := protodesc.NewFile(&file, nil)
	if err != nil {
		fail(2, "%s: %v", *descriptor, err)
	}
	md := fd.Messages().ByName(protoreflect.FullName(*name).Name())
	if md == nil || md.FullName() != protoreflect.FullName(*name) {
		fail(2, "no message %s in %s", *name, *descriptor)
	}
	body, err := io.ReadAll(os.Stdin)
	if err != nil {
		fail(2, "stdin: %v", err)
	}
	message := dynamicpb.NewMessage(md)
	if err := proto.Unmarshal(body, message); err != nil {
		fail(1, "not a %s: %v", *name, err)
	}
	out, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(message)
	if err != nil {
		fail(1, "%v", err)
	}
	fmt.Println(string(out))
}
