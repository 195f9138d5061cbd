// Command loadgen offers Decide load to a compilecast coordinator, as
// bench/decisions.py's Python load generator does, at a fraction of its CPU:
// on a 2-core machine the Python one takes most of the core it shares with
// etcd, so its own queueing shows up in the latencies it reports.
//
// Open loop: `-rate` requests a second in all (Poisson arrivals), each from
// one of `-clients` clients, over `-streams` Decide streams. Each stream
// writes one message at a time, at least `-gap` apart; the requests that
// arrive meanwhile leave together in the next (as compilecast's Decider
// coalesces), and every
// message takes its answer in parts (DecideRequest.answer_in_parts) and
// bundled with other messages' answers (takes_bundles; with -bundles=false
// each answer comes as a message of its own). A request is a hit (one of
// -hit-keys published keys) with probability -hit-ratio, else a new key.
// Prints one JSON object.
//
// Messages are encoded and decoded with protowire (no generated code): the
// field numbers are those of protos/compilecast/v1/cache.proto.
package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"math/rand"
	"os"
	"sort"
	"strings"
	"sync"
	"time"

	"compilecast/bench/loadgen/raw"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protowire"
)

// At least this long between two messages of a stream, as compilecast's
// Decider (decide.GAP_S): the requests that arrive meanwhile leave together.
var gap = 5 * time.Millisecond

const maxBatch = 1000 // requests per message, as compilecast.decide.MAX_BATCH

var decisionNames = map[uint64]string{0: "DECISION_UNSPECIFIED", 1: "HIT", 2: "COMPILE",
	3: "WAIT", 4: "COMPILE_LOCALLY"}

var decideDesc = &grpc.StreamDesc{StreamName: "Decide", ServerStreams: true, ClientStreams: true}

type request struct {
	key, client string
	t0          time.Time
	plain       bool // sent without key components (a job's other processes' HITs)
}

type sent struct {
	reqs     []request
	answered []bool
	left     int
}

// results of one stream's answers
type results struct {
	latencies  []float64
	arrivals   []float64 // when each answered request was asked, seconds from the start
	byDecision map[string][]float64
	errors     int
}

type stream struct {
	cs       grpc.ClientStream
	mu       sync.Mutex
	queue    []request
	wake     chan struct{}
	inflight map[uint64]*sent
	nextID   uint64
	messages int // messages sent
	received int // answer messages received
	pending  int // requests queued or in flight
	res      results
	idle     *sync.Cond
	// The server's gap advice (DecideResponse.gap_ms), followed for
	// adviceFor after the answer that carried it, as the Decider does.
	advised   time.Duration
	advisedAt time.Time
	adviceMax time.Duration // the longest advice seen (reported)
}

const (
	adviceFor  = time.Second
	maxAdvised = 50 * time.Millisecond
)

// nextGap is the gap after a message: -gap, or the server's recent advice
// when longer (s.mu held).
func (s *stream) nextGap() time.Duration {
	if s.advised > gap && time.Since(s.advisedAt) < adviceFor {
		return s.advised
	}
	return gap
}

// advise takes an answer's gap advice, capped, as the Decider does (s.mu held).
func (s *stream) advise(a answer) {
	s.advised, s.advisedAt = min(time.Duration(a.gapMs)*time.Millisecond, maxAdvised), time.Now()
	s.adviceMax = max(s.adviceMax, s.advised)
}

var bundles = true // the requests say the client takes bundled answers

// components is how many named key components each request carries (as the
// JAX integration's requests do; the coordinator records them on a miss).
var components = 0

// hitsEvery: a HIT request carries the components only from one client in
// this many (a job's lowest-id process; its other processes leave them out,
// as the JAX integration's do). A miss stands for that process's COMPILE and
// always carries them.
var hitsEvery = 1

// appendComponents adds `components` key_components entries and a program
// name, as a worker sends them: the first ("program") a digest of the key,
// the others of the client (its platform, flags and so on), so that two keys
// of one client differ in their program alone.
func appendComponents(acq []byte, r request) []byte {
	if components == 0 || r.plain {
		return acq
	}
	for i := 0; i < components; i++ {
		name, of := fmt.Sprintf("component_%d", i), r.client
		if i == 0 {
			name, of = "program", r.key
		}
		sum := sha256.Sum256([]byte(of + "/" + name))
		var entry []byte
		entry = protowire.AppendTag(entry, 1, protowire.BytesType)
		entry = protowire.AppendString(entry, name)
		entry = protowire.AppendTag(entry, 2, protowire.BytesType)
		entry = protowire.AppendString(entry, hex.EncodeToString(sum[:]))
		acq = protowire.AppendTag(acq, 3, protowire.BytesType)
		acq = protowire.AppendBytes(acq, entry)
	}
	acq = protowire.AppendTag(acq, 4, protowire.BytesType)
	return protowire.AppendString(acq, "jit_step_"+r.client[len(r.client)-1:])
}

func encodeRequest(id uint64, reqs []request) []byte {
	b := protowire.AppendTag(nil, 1, protowire.VarintType)
	b = protowire.AppendVarint(b, id)
	for _, r := range reqs {
		var requester []byte
		requester = protowire.AppendTag(requester, 4, protowire.BytesType)
		requester = protowire.AppendString(requester, r.client)
		var acq []byte
		acq = protowire.AppendTag(acq, 1, protowire.BytesType)
		acq = protowire.AppendString(acq, r.key)
		acq = protowire.AppendTag(acq, 2, protowire.BytesType)
		acq = protowire.AppendBytes(acq, requester)
		acq = appendComponents(acq, r)
		b = protowire.AppendTag(b, 2, protowire.BytesType)
		b = protowire.AppendBytes(b, acq)
	}
	b = protowire.AppendTag(b, 6, protowire.VarintType) // answer_in_parts
	b = protowire.AppendVarint(b, 1)
	if bundles {
		b = protowire.AppendTag(b, 7, protowire.VarintType) // takes_bundles
		b = protowire.AppendVarint(b, 1)
	}
	return b
}

type answer struct {
	id        uint64
	decisions []uint64
	positions []uint64
	errorCode uint64
	gapMs     uint64   // the server's gap advice
	more      []answer // answers to other messages, bundled with this one
}

func fields(b []byte, each func(num protowire.Number, typ protowire.Type, v []byte, u uint64) error) error {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		switch typ {
		case protowire.VarintType:
			u, m := protowire.ConsumeVarint(b)
			if m < 0 {
				return protowire.ParseError(m)
			}
			if err := each(num, typ, nil, u); err != nil {
				return err
			}
			b = b[m:]
		case protowire.BytesType:
			v, m := protowire.ConsumeBytes(b)
			if m < 0 {
				return protowire.ParseError(m)
			}
			if err := each(num, typ, v, 0); err != nil {
				return err
			}
			b = b[m:]
		default:
			m := protowire.ConsumeFieldValue(num, typ, b)
			if m < 0 {
				return protowire.ParseError(m)
			}
			b = b[m:]
		}
	}
	return nil
}

func decodeAnswer(b []byte) (answer, error) {
	var a answer
	err := fields(b, func(num protowire.Number, typ protowire.Type, v []byte, u uint64) error {
		switch {
		case num == 1 && typ == protowire.VarintType:
			a.id = u
		case num == 2 && typ == protowire.BytesType:
			var decision uint64
			if err := fields(v, func(n protowire.Number, t protowire.Type, _ []byte, x uint64) error {
				if n == 1 && t == protowire.VarintType {
					decision = x
				}
				return nil
			}); err != nil {
				return err
			}
			a.decisions = append(a.decisions, decision)
		case num == 3 && typ == protowire.VarintType:
			a.errorCode = u
		case num == 9 && typ == protowire.VarintType:
			a.gapMs = u
		case num == 6 && typ == protowire.BytesType: // packed positions
			for len(v) > 0 {
				p, m := protowire.ConsumeVarint(v)
				if m < 0 {
					return protowire.ParseError(m)
				}
				a.positions = append(a.positions, p)
				v = v[m:]
			}
		case num == 6 && typ == protowire.VarintType:
			a.positions = append(a.positions, u)
		case num == 8 && typ == protowire.BytesType: // bundled answers
			more, err := decodeAnswer(v)
			if err != nil {
				return err
			}
			a.more = append(a.more, more)
		}
		return nil
	})
	return a, err
}

func (s *stream) enqueue(r request) {
	s.mu.Lock()
	s.queue = append(s.queue, r)
	s.pending++
	s.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

func (s *stream) write() {
	for range s.wake {
		for {
			s.mu.Lock()
			if len(s.queue) == 0 {
				s.mu.Unlock()
				break
			}
			n := min(len(s.queue), maxBatch)
			reqs := append([]request(nil), s.queue[:n]...)
			s.queue = s.queue[n:]
			s.nextID++
			id := s.nextID
			s.inflight[id] = &sent{reqs: reqs, answered: make([]bool, n), left: n}
			s.messages++
			s.mu.Unlock()
			msg := encodeRequest(id, reqs)
			sentAt := time.Now()
			if err := s.cs.SendMsg(&msg); err != nil {
				fmt.Fprintln(os.Stderr, "send:", err)
				os.Exit(1)
			}
			s.mu.Lock()
			wait := s.nextGap()
			s.mu.Unlock()
			if wait > 0 {
				time.Sleep(wait - time.Since(sentAt))
			}
		}
	}
}

func (s *stream) done(r request, decision string, failed bool) {
	if failed {
		s.res.errors++
	} else {
		lat := time.Since(r.t0).Seconds()
		s.res.latencies = append(s.res.latencies, lat)
		s.res.arrivals = append(s.res.arrivals, r.t0.Sub(start).Seconds())
		s.res.byDecision[decision] = append(s.res.byDecision[decision], lat)
	}
	s.pending--
	if s.pending == 0 {
		s.idle.Broadcast()
	}
}

func (s *stream) read() {
	for {
		var buf []byte
		if err := s.cs.RecvMsg(&buf); err != nil {
			return
		}
		a, err := decodeAnswer(buf)
		if err != nil {
			fmt.Fprintln(os.Stderr, "decode:", err)
			os.Exit(1)
		}
		s.mu.Lock()
		s.received++
		s.advise(a)
		s.settle(a)
		for _, more := range a.more {
			s.settle(more)
		}
		s.mu.Unlock()
	}
}

// settle the requests one answer answers (s.mu held).
func (s *stream) settle(a answer) {
	m := s.inflight[a.id]
	if m == nil {
		return
	}
	positions := a.positions
	if len(positions) == 0 {
		positions = make([]uint64, len(m.reqs))
		for i := range positions {
			positions[i] = uint64(i)
		}
	}
	for j, p := range positions {
		if p >= uint64(len(m.reqs)) || m.answered[p] {
			continue
		}
		m.answered[p] = true
		m.left--
		if a.errorCode != 0 || j >= len(a.decisions) {
			s.done(m.reqs[p], "", true)
		} else {
			s.done(m.reqs[p], decisionNames[a.decisions[j]], false)
		}
	}
	if m.left == 0 {
		delete(s.inflight, a.id)
	}
}

func quantiles(v []float64) [2]float64 {
	if len(v) == 0 {
		return [2]float64{0, 0}
	}
	sort.Float64s(v)
	return [2]float64{v[len(v)/2] * 1e3, v[int(float64(len(v))*0.99)] * 1e3}
}

var start time.Time // when the clock started

func main() {
	target := flag.String("target", "127.0.0.1:7070",
		"the coordinator (host:port), or several, comma-separated: connections go round them")
	clients := flag.Int("clients", 1000, "clients the requests come from")
	streams := flag.Int("streams", 8, "Decide streams")
	channels := flag.Int("channels", 8, "connections the streams are spread over")
	rate := flag.Float64("rate", 5000, "requests per second, all clients together")
	seconds := flag.Float64("seconds", 10, "how long to offer load")
	hitRatio := flag.Float64("hit-ratio", 0.9, "share of requests for published keys")
	hitKeys := flag.String("hit-keys", "", "the published keys, comma-separated")
	flag.DurationVar(&gap, "gap", gap, "at least this long between two messages of a stream (what arrives meanwhile coalesces), as the Decider's gap")
	flag.BoolVar(&bundles, "bundles", true, "take answers bundled (DecideRequest.takes_bundles)")
	flag.IntVar(&hitsEvery, "components-hits-every", hitsEvery, "with -components: a HIT request carries them from one client in this many (a job's lowest-id process); misses always do")
	flag.IntVar(&components, "components", components, "key components each request carries, with a program name (as the JAX integration sends; the coordinator records them on a miss)")
	flag.Parse()
	hits := strings.Split(*hitKeys, ",")
	if *hitKeys == "" || *streams < 1 || *channels < 1 || *rate <= 0 || hitsEvery < 1 {
		fmt.Fprintln(os.Stderr, "loadgen: -hit-keys, -streams >= 1, -channels >= 1, -rate > 0 and -components-hits-every >= 1 are required")
		os.Exit(2)
	}
	targets := strings.Split(*target, ",")
	conns := make([]*grpc.ClientConn, max(*channels, len(targets)))
	for i := range conns {
		c, err := grpc.NewClient(targets[i%len(targets)],
			grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			fmt.Fprintln(os.Stderr, "loadgen:", err)
			os.Exit(1)
		}
		conns[i] = c
	}
	ss := make([]*stream, *streams)
	for i := range ss {
		cs, err := conns[i%len(conns)].NewStream(context.Background(), decideDesc,
			"/compilecast.v1.CompileCache/Decide", grpc.ForceCodec(raw.Codec{}))
		if err != nil {
			fmt.Fprintln(os.Stderr, "loadgen:", err)
			os.Exit(1)
		}
		s := &stream{cs: cs, wake: make(chan struct{}, 1), inflight: map[uint64]*sent{},
			res: results{byDecision: map[string][]float64{}}}
		s.idle = sync.NewCond(&s.mu)
		ss[i] = s
		go s.write()
		go s.read()
	}
	// Streams open before the clock starts (workers keep theirs open).
	for _, s := range ss {
		s.enqueue(request{key: hits[0], client: "warm", t0: time.Now()})
	}
	for _, s := range ss {
		s.mu.Lock()
		for s.pending > 0 {
			s.idle.Wait()
		}
		s.res = results{byDecision: map[string][]float64{}}
		s.messages, s.received = 0, 0
		s.mu.Unlock()
	}
	run := fmt.Sprintf("%d-%d", os.Getpid(), time.Now().UnixNano())
	rng := rand.New(rand.NewSource(0))
	cpu0, t0 := raw.CPUSeconds(), time.Now()
	start = t0
	deadline := t0.Add(time.Duration(*seconds * float64(time.Second)))
	due := t0
	counter := 0
	for due.Before(deadline) {
		due = due.Add(time.Duration(rng.ExpFloat64() / *rate * float64(time.Second)))
		if wait := time.Until(due); wait > time.Millisecond {
			time.Sleep(wait)
		}
		i := rng.Intn(*clients)
		var key string
		plain := false
		if rng.Float64() < *hitRatio {
			key = hits[rng.Intn(len(hits))]
			plain = i%hitsEvery != 0
		} else {
			counter++
			key = fmt.Sprintf("miss-%s-%d-%d", run, i, counter)
		}
		ss[i%len(ss)].enqueue(request{key: key, client: fmt.Sprintf("bench:%d", i), t0: time.Now(),
			plain: plain})
	}
	finished := make(chan struct{})
	go func() {
		for _, s := range ss {
			s.mu.Lock()
			for s.pending > 0 {
				s.idle.Wait()
			}
			s.mu.Unlock()
		}
		close(finished)
	}()
	select {
	case <-finished:
	case <-time.After(60 * time.Second):
		fmt.Fprintln(os.Stderr, "loadgen: requests left unanswered after 60 s")
	}
	wall := time.Since(t0).Seconds()
	cpu := raw.CPUSeconds() - cpu0
	var all []float64
	perSecond := make([][]float64, int(*seconds)+1)
	by := map[string][]float64{}
	counts := map[string]int{}
	errors, messages, received := 0, 0, 0
	var adviceMax time.Duration
	for _, s := range ss {
		s.mu.Lock()
		all = append(all, s.res.latencies...)
		for j, at := range s.res.arrivals {
			if k := int(at); k >= 0 && k < len(perSecond) {
				perSecond[k] = append(perSecond[k], s.res.latencies[j])
			}
		}
		for k, v := range s.res.byDecision {
			by[k] = append(by[k], v...)
			counts[k] += len(v)
		}
		errors += s.res.errors
		adviceMax = max(adviceMax, s.adviceMax)
		messages += s.messages
		received += s.received
		s.mu.Unlock()
		s.cs.CloseSend()
	}
	byQ := map[string][2]float64{}
	for k, v := range by {
		byQ[k] = quantiles(v)
	}
	q := quantiles(all)
	p99BySecond := make([]float64, len(perSecond))
	for k, v := range perSecond {
		p99BySecond[k] = quantiles(v)[1]
	}
	out := map[string]any{
		"requests": len(all), "per_second": float64(len(all)) / wall, "p50_ms": q[0],
		"p99_ms": q[1], "errors": errors, "by_decision": counts, "stream_messages": messages, "answer_messages": received,
		"p50_p99_ms_by_decision": byQ, "p99_ms_by_second_asked": p99BySecond, "load_generator_cores": cpu / wall, "wall_s": wall,
		"advised_gap_ms_max": adviceMax.Seconds() * 1e3,
	}
	enc := json.NewEncoder(os.Stdout)
	if err := enc.Encode(out); err != nil {
		os.Exit(1)
	}
}
