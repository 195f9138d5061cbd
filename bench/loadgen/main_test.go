package main

import (
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protowire"
)

// response encodes a DecideResponse as cache.proto lays it out: id 1,
// responses 2 (each with decision 1), packed positions 6, bundled more 8.
func response(id uint64, decisions []uint64, positions []uint64, more ...[]byte) []byte {
	b := protowire.AppendTag(nil, 1, protowire.VarintType)
	b = protowire.AppendVarint(b, id)
	for _, d := range decisions {
		r := protowire.AppendTag(nil, 1, protowire.VarintType)
		r = protowire.AppendVarint(r, d)
		b = protowire.AppendTag(b, 2, protowire.BytesType)
		b = protowire.AppendBytes(b, r)
	}
	if len(positions) > 0 {
		var p []byte
		for _, x := range positions {
			p = protowire.AppendVarint(p, x)
		}
		b = protowire.AppendTag(b, 6, protowire.BytesType)
		b = protowire.AppendBytes(b, p)
	}
	for _, m := range more {
		b = protowire.AppendTag(b, 8, protowire.BytesType)
		b = protowire.AppendBytes(b, m)
	}
	return b
}

func TestABundleSettlesEveryMessageItAnswers(t *testing.T) {
	s := &stream{inflight: map[uint64]*sent{}, res: results{byDecision: map[string][]float64{}}}
	s.idle = sync.NewCond(&s.mu)
	for id, n := range map[uint64]int{1: 1, 2: 3, 3: 1} {
		reqs := make([]request, n)
		s.inflight[id] = &sent{reqs: reqs, answered: make([]bool, n), left: n}
		s.pending += n
	}
	// 1 whole (HIT), 2 in two parts (HIT at 0; COMPILE at 1 and 2), 3 whole (WAIT).
	raw := response(1, []uint64{1}, nil,
		response(2, []uint64{1}, []uint64{0}),
		response(2, []uint64{2, 2}, []uint64{1, 2}),
		response(3, []uint64{3}, nil))
	a, err := decodeAnswer(raw)
	if err != nil {
		t.Fatal(err)
	}
	if len(a.more) != 3 {
		t.Fatalf("decoded %d bundled answers, want 3", len(a.more))
	}
	s.settle(a)
	for _, m := range a.more {
		s.settle(m)
	}
	if len(s.inflight) != 0 || s.pending != 0 || s.res.errors != 0 {
		t.Fatalf("left in flight %d, pending %d, errors %d", len(s.inflight), s.pending, s.res.errors)
	}
	got := map[string]int{}
	for k, v := range s.res.byDecision {
		got[k] = len(v)
	}
	want := map[string]int{decisionNames[1]: 2, decisionNames[2]: 2, decisionNames[3]: 1}
	for k, v := range want {
		if got[k] != v {
			t.Fatalf("by decision %v, want %v", got, want)
		}
	}
}

func TestTheServersGapAdviceIsFollowedCappedAndForgotten(t *testing.T) {
	withGap := func(ms uint64) answer {
		raw := protowire.AppendTag(response(1, []uint64{1}, nil), 9, protowire.VarintType)
		a, err := decodeAnswer(protowire.AppendVarint(raw, ms))
		if err != nil {
			t.Fatal(err)
		}
		return a
	}
	s := &stream{}
	if got := s.nextGap(); got != gap {
		t.Fatalf("no advice: gap %v, want the own %v", got, gap)
	}
	s.advise(withGap(12))
	if got := s.nextGap(); got != 12*time.Millisecond {
		t.Fatalf("advised 12 ms: gap %v", got)
	}
	s.advise(withGap(10_000))
	if got := s.nextGap(); got != maxAdvised {
		t.Fatalf("advised 10 s: gap %v, want the cap %v", got, maxAdvised)
	}
	s.advisedAt = time.Now().Add(-2 * adviceFor)
	if got := s.nextGap(); got != gap {
		t.Fatalf("stale advice: gap %v, want the own %v", got, gap)
	}
	s.advise(withGap(0))
	if got := s.nextGap(); got != gap || s.adviceMax != maxAdvised {
		t.Fatalf("advice withdrawn: gap %v (want %v), longest seen %v", got, gap, s.adviceMax)
	}
}

// countComponents is how many key_components (field 3) the first
// AcquireRequest (field 2) of an encoded DecideRequest holds.
func countComponents(t *testing.T, b []byte) int {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		b = b[n:]
		if num == 2 && typ == protowire.BytesType {
			acq, _ := protowire.ConsumeBytes(b)
			count := 0
			for len(acq) > 0 {
				f, ft, m := protowire.ConsumeTag(acq)
				acq = acq[m:]
				if f == 3 {
					count++
				}
				acq = acq[protowire.ConsumeFieldValue(f, ft, acq):]
			}
			return count
		}
		b = b[protowire.ConsumeFieldValue(num, typ, b):]
	}
	t.Fatal("no AcquireRequest in the encoded request")
	return 0
}

func TestAPlainRequestLeavesTheComponentsOut(t *testing.T) {
	saved := components
	defer func() { components = saved }()
	components = 11
	full := encodeRequest(1, []request{{key: "k", client: "bench:3"}})
	plain := encodeRequest(2, []request{{key: "k", client: "bench:3", plain: true}})
	if got := countComponents(t, full); got != 11 {
		t.Fatalf("a request with components carries %d, want 11", got)
	}
	if got := countComponents(t, plain); got != 0 {
		t.Fatalf("a plain request carries %d components, want 0", got)
	}
}
