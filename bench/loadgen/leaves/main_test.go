package main

import (
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
)

// jobEvents encodes a JobEvents as cache.proto lays it out: published 1
// (ArtifactInfo, key 1), ask 2, turns 3 (KeyTurn, key 1), claimed 4, seq 6,
// epoch 7, resumed 8, relay_from 9.
func jobEvents(published, ask, claimed []string, seq int64, epoch string) []byte {
	var b []byte
	for _, k := range published {
		info := protowire.AppendTag(nil, 1, protowire.BytesType)
		info = protowire.AppendString(info, k)
		info = protowire.AppendTag(info, 2, protowire.BytesType) // digest: skipped
		info = protowire.AppendString(info, "abc")
		b = protowire.AppendTag(b, 1, protowire.BytesType)
		b = protowire.AppendBytes(b, info)
	}
	for _, k := range ask {
		b = protowire.AppendTag(b, 2, protowire.BytesType)
		b = protowire.AppendString(b, k)
	}
	for _, k := range claimed {
		b = protowire.AppendTag(b, 4, protowire.BytesType)
		b = protowire.AppendString(b, k)
	}
	b = protowire.AppendTag(b, 6, protowire.VarintType)
	b = protowire.AppendVarint(b, uint64(seq))
	if epoch != "" {
		b = protowire.AppendTag(b, 7, protowire.BytesType)
		b = protowire.AppendString(b, epoch)
	}
	return b
}

func TestJoinedNewsParsesAsItsMessagesMerged(t *testing.T) {
	// A relay joins news waiting for a slow stream by concatenation: the
	// lists in order, the last seq.
	joined := append(jobEvents([]string{"a", "b"}, nil, []string{"c"}, 4, "e1"),
		jobEvents([]string{"c"}, []string{"d"}, nil, 5, "")...)
	e, err := decodeEvents(joined)
	if err != nil {
		t.Fatal(err)
	}
	if len(e.published) != 3 || e.published[2] != "c" || len(e.ask) != 1 || e.ask[0] != "d" ||
		len(e.claimed) != 1 || e.seq != 5 || !e.hasSeq || e.epoch != "e1" {
		t.Fatalf("decoded %+v", e)
	}
	if _, err := decodeEvents([]byte{0x0a, 0x05, 'x'}); err == nil {
		t.Fatal("a truncated message decoded")
	}
}

func TestAHostHearsNewsAndEndsItsWait(t *testing.T) {
	h := newHost(&pod{job: "j"}, 7)
	h.woke = make(chan error, 1)
	h.waiting = "k1"
	h.take(events{claimed: []string{"k1"}})
	select {
	case err := <-h.woke:
		t.Fatalf("a claim ended the wait: %v", err)
	default:
	}
	h.take(events{published: []string{"k0", "k1"}, seq: 3, hasSeq: true})
	if err := <-h.woke; err != nil || h.seq != 3 || !h.heard["k0"] || h.claimed["k1"] {
		t.Fatalf("the wait ended %v; seq %d, heard %v, claimed %v", err, h.seq, h.heard, h.claimed)
	}
	h.waiting = "k2"
	h.take(events{ask: []string{"k2"}})
	if err := <-h.woke; err == nil {
		t.Fatal("an ask ended the wait as a hit")
	}
}
