// Command krproxy-godecode reads one protobuf message the way a Go program does, with
// google.golang.org/protobuf, and prints it as JSON: what koord-runtime-proxy (Go) makes of the
// bytes krproxy's SDK answers, maps included (a key repeated on the wire keeps its last value).
//
// Usage: krproxy-godecode -descriptor FILE < MESSAGES
//
// FILE holds a serialized FileDescriptorProto that imports nothing (krproxy's
// runtime_hook_v1alpha1.proto, or the CRI's). Messages come on stdin one after the other until it
// ends: each as a 4-byte big-endian length and the message's full name in FILE, then a 4-byte length
// and its bytes. For each, stdout gets a status byte (0 decoded, 1 the bytes are no such message, 2
// no such name or a panic, whose text starts "panic: "), a 4-byte length, and the JSON line
// (protojson, proto field names) or the error text. One process serves a test's hundreds of
// messages: a process per message cost 9 ms of CPU each. Exit 0 when stdin ends, 2 on bad flags,
// an unreadable descriptor or a cut record.
package main

import (
	"bufio"
	"encoding/binary"
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

type failure struct {
	code int
	text string
}

// decode reads body as the message name of fd: its protojson line, or why not.
func decode(fd protoreflect.FileDescriptor, name string, body []byte) (out []byte, fault *failure) {
	defer func() {
		if r := recover(); r != nil {
			out, fault = nil, &failure{2, fmt.Sprintf("panic: %v", r)}
		}
	}()
	md := fd.Messages().ByName(protoreflect.FullName(name).Name())
	if md == nil || md.FullName() != protoreflect.FullName(name) {
		return nil, &failure{2, fmt.Sprintf("no message %s", name)}
	}
	message := dynamicpb.NewMessage(md)
	if err := proto.Unmarshal(body, message); err != nil {
		return nil, &failure{1, fmt.Sprintf("not a %s: %v", name, err)}
	}
	out, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(message)
	if err != nil {
		return nil, &failure{1, err.Error()}
	}
	return out, nil
}

func readChunk(in *bufio.Reader) ([]byte, error) {
	var size [4]byte
	if _, err := io.ReadFull(in, size[:]); err != nil {
		return nil, err
	}
	chunk := make([]byte, binary.BigEndian.Uint32(size[:]))
	_, err := io.ReadFull(in, chunk)
	return chunk, err
}

// batch answers every message on stdin, in order, until stdin ends.
func batch(fd protoreflect.FileDescriptor) {
	in, out := bufio.NewReader(os.Stdin), bufio.NewWriter(os.Stdout)
	for {
		name, err := readChunk(in)
		if err == io.EOF {
			return
		}
		var body []byte
		if err == nil {
			body, err = readChunk(in)
		}
		if err != nil {
			fail(2, "stdin: %v", err)
		}
		code, text := 0, []byte(nil)
		if decoded, fault := decode(fd, string(name), body); fault != nil {
			code, text = fault.code, []byte(fault.text)
		} else {
			text = append(decoded, '\n')
		}
		var head [5]byte
		head[0] = byte(code)
		binary.BigEndian.PutUint32(head[1:], uint32(len(text)))
		out.Write(head[:])
		out.Write(text)
		if err := out.Flush(); err != nil {
			fail(2, "stdout: %v", err)
		}
	}
}

func main() {
	descriptor := flag.String("descriptor", "", "a serialized FileDescriptorProto")
	flag.Parse()
	if *descriptor == "" || flag.NArg() != 0 {
		fail(2, "usage: krproxy-godecode -descriptor FILE < MESSAGES")
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
	batch(fd)
}
