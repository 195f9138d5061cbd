// Package raw is what bench/loadgen's commands share: a gRPC codec that
// sends and receives messages as the bytes they encode and decode with
// protowire (no generated code; the field numbers are those of
// protos/compilecast/v1/cache.proto), and the process's CPU-seconds.
package raw

import "syscall"

// Codec sends and receives messages as the bytes the caller encodes and
// decodes (a *[]byte each way).
type Codec struct{}

func (Codec) Marshal(v any) ([]byte, error) { return *(v.(*[]byte)), nil }

func (Codec) Unmarshal(data []byte, v any) error {
	*(v.(*[]byte)) = append([]byte(nil), data...)
	return nil
}

func (Codec) Name() string { return "proto" }

// CPUSeconds is the process's user and system CPU time so far.
func CPUSeconds() float64 {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e9
}
