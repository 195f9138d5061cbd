// Command leaves holds the hosts of one job at the leaves of its tree, as
// the protocol sees them, for bench/pod_cold.py: each host one WatchJob
// stream (opened at the coordinator, which may point it at a relaying
// worker, and so down the tree), waiting for the job's programs in turn, as
// compilecast's JobStream (worker/daemon/jobstream.py) has a host's
// processes wait:
//
//   - a program heard published (the job's news) is a HIT;
//   - a program waited for that nobody has claimed after -name-after is
//     named upstream on the stream, once;
//   - a stream that breaks is opened again at once with the last news it
//     heard (since_epoch, since_seq); where the news did not resume, the
//     program it waits for is named again;
//   - "ask for it one by one", or a turn to compile, fails the host (the
//     bench's hosts at the leaves rank after the relays, which take turns).
//
// One process holds thousands of hosts at a fraction of the CPU the same
// hosts cost as Python processes; the relays above them are the worker's own
// code. Line protocol: prints "ready" once every host's stream is open and
// placed, starts on a line "go" on stdin, then prints one JSON object (the
// last host's end in Unix seconds and the ends' quantiles, the hosts that
// failed and why, the keys named, the turns heard, its CPU-seconds from "go",
// the streams opened again) and ends on a line "end".
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"runtime/debug"
	"runtime/pprof"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"compilecast/bench/loadgen/raw"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protowire"
)

const (
	method         = "/compilecast.v1.CompileCache/WatchJob"
	maxHops        = 8           // relays a stream is pointed through (JobStream.MAX_HOPS)
	heldFor        = time.Second // open this long: opened again at once (JobStream.HELD_S)
	pauseAfter     = 100 * time.Millisecond
	hostsAChannel  = 100  // hosts sharing a connection to the coordinator
	opensAtOnce    = 256  // streams opening at a time (before the clock)
	openedWithinS  = 120  // every stream open within this, or the run fails
	maxKeysMessage = 1000 // keys a message names (jobtree.MAX_WAITS)
)

var watchDesc = &grpc.StreamDesc{StreamName: "WatchJob", ServerStreams: true, ClientStreams: true}

// events is what a host reads of a JobEvents message (news joined on its way
// parses as the messages' merge: lists in order, the last seq).
type events struct {
	published, ask, turns, claimed []string
	seq                            int64
	hasSeq                         bool
	epoch, relayFrom               string
	resumed                        bool
}

func decodeEvents(b []byte) (events, error) {
	var e events
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return e, protowire.ParseError(n)
		}
		b = b[n:]
		var v []byte
		var x uint64
		switch typ {
		case protowire.BytesType:
			v, n = protowire.ConsumeBytes(b)
		case protowire.VarintType:
			x, n = protowire.ConsumeVarint(b)
		default:
			n = protowire.ConsumeFieldValue(num, typ, b)
		}
		if n < 0 {
			return e, protowire.ParseError(n)
		}
		b = b[n:]
		switch num {
		case 1: // published: ArtifactInfo, its key 1
			e.published = append(e.published, firstString(v))
		case 2:
			e.ask = append(e.ask, string(v))
		case 3: // turns: KeyTurn, its key 1
			e.turns = append(e.turns, firstString(v))
		case 4:
			e.claimed = append(e.claimed, string(v))
		case 6:
			e.seq, e.hasSeq = int64(x), true
		case 7:
			e.epoch = string(v)
		case 8:
			e.resumed = x != 0
		case 9:
			e.relayFrom = string(v)
		}
	}
	return e, nil
}

// firstString is field 1 of a message, as a string ("" where absent).
func firstString(b []byte) string {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return ""
		}
		b = b[n:]
		if num == 1 && typ == protowire.BytesType {
			v, _ := protowire.ConsumeBytes(b)
			return string(v)
		}
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return ""
		}
		b = b[n:]
	}
	return ""
}

func requester(job string, rank int) []byte {
	b := protowire.AppendTag(nil, 1, protowire.BytesType)
	b = protowire.AppendString(b, job)
	b = protowire.AppendTag(b, 2, protowire.VarintType)
	b = protowire.AppendVarint(b, uint64(rank))
	b = protowire.AppendTag(b, 4, protowire.BytesType)
	return protowire.AppendString(b, fmt.Sprintf("host%d", rank))
}

// opening is a stream's first JobWatchRequest: its job, its rank, one host,
// and the news it heard last (where it resumes).
func opening(job string, rank int, epoch string, seq int64, direct bool) []byte {
	b := protowire.AppendTag(nil, 1, protowire.BytesType)
	b = protowire.AppendString(b, job)
	b = protowire.AppendTag(b, 3, protowire.BytesType)
	b = protowire.AppendBytes(b, requester(job, rank))
	if epoch != "" {
		b = protowire.AppendTag(b, 5, protowire.BytesType)
		b = protowire.AppendString(b, epoch)
		b = protowire.AppendTag(b, 6, protowire.VarintType)
		b = protowire.AppendVarint(b, uint64(seq))
	}
	if direct {
		b = protowire.AppendTag(b, 7, protowire.VarintType)
		b = protowire.AppendVarint(b, 1)
	}
	b = protowire.AppendTag(b, 8, protowire.VarintType)
	return protowire.AppendVarint(b, 1)
}

// naming is a JobWatchRequest that names keys (waits 2: WaitRequest{key 1, requester 2}).
func naming(job string, rank int, keys []string) []byte {
	me := requester(job, rank)
	var b []byte
	for _, k := range keys {
		w := protowire.AppendTag(nil, 1, protowire.BytesType)
		w = protowire.AppendString(w, k)
		w = protowire.AppendTag(w, 2, protowire.BytesType)
		w = protowire.AppendBytes(w, me)
		b = protowire.AppendTag(b, 2, protowire.BytesType)
		b = protowire.AppendBytes(b, w)
	}
	return b
}

// pod is what the hosts share: their connections and counters.
type pod struct {
	job       string
	keys      []string
	nameAfter time.Duration
	coord     []*grpc.ClientConn
	mu        sync.Mutex
	peers     map[string]*grpc.ClientConn
	named     atomic.Int64
	reopened  atomic.Int64
	turns     atomic.Int64
	restarted atomic.Int64
}

func dial(target string) *grpc.ClientConn {
	c, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		fmt.Fprintln(os.Stderr, "leaves:", err)
		os.Exit(1)
	}
	return c
}

func (p *pod) peer(address string) *grpc.ClientConn {
	p.mu.Lock()
	defer p.mu.Unlock()
	c, ok := p.peers[address]
	if !ok {
		c = dial(address)
		p.peers[address] = c
	}
	return c
}

// host is one host at a leaf: its stream and what it heard.
type host struct {
	pod  *pod
	rank int

	mu       sync.Mutex
	stream   grpc.ClientStream
	cancel   context.CancelFunc
	live     bool
	epoch    string
	seq      int64
	heard    map[string]bool
	claimed  map[string]bool
	asked    map[string]bool
	named    map[string]bool
	waiting  string
	since    time.Time   // when the wait began
	timer    *time.Timer // names the key waited for, late
	woke     chan error  // a wait's end: nil (heard), or why it failed
	openedCh chan struct{}
	opened   bool
}

func newHost(p *pod, rank int) *host {
	return &host{pod: p, rank: rank, heard: map[string]bool{}, claimed: map[string]bool{},
		asked: map[string]bool{}, named: map[string]bool{}, openedCh: make(chan struct{})}
}

// send writes a request on the current stream (lost with a broken one: the
// next opening names again what is unanswered).
func (h *host) sendLocked(b []byte) {
	if h.live && h.stream != nil {
		_ = h.stream.SendMsg(&b)
	}
}

// nameLocked names keys nobody has claimed, once each while unanswered.
func (h *host) nameLocked(keys []string) {
	var out []string
	for _, k := range keys {
		if !h.claimed[k] && !h.named[k] {
			h.named[k] = true
			out = append(out, k)
		}
	}
	for len(out) > 0 {
		page := out[:min(len(out), maxKeysMessage)]
		out = out[len(page):]
		h.pod.named.Add(int64(len(page)))
		h.sendLocked(naming(h.pod.job, h.rank, page))
	}
}

// follow keeps the host's stream open: opened, read to its end, opened again.
func (h *host) follow(ctx context.Context) {
	for ctx.Err() == nil {
		began := time.Now()
		err := h.open(ctx)
		if err == nil {
			err = h.read()
		}
		h.mu.Lock()
		h.live = false
		if h.cancel != nil {
			h.cancel()
			h.cancel = nil
		}
		h.mu.Unlock()
		if ctx.Err() != nil {
			return
		}
		if os.Getenv("LEAVES_DEBUG") != "" {
			fmt.Fprintf(os.Stderr, "host %d: stream ended: %v\n", h.rank, err)
		}
		h.pod.reopened.Add(1)
		if time.Since(began) < heldFor {
			time.Sleep(pauseAfter)
		}
	}
}

// open opens a stream at the coordinator and follows relay_from down the tree.
func (h *host) open(ctx context.Context) error {
	target, direct := "", false
	for hop := 0; hop <= maxHops; hop++ {
		conn := h.pod.coord[(h.rank/hostsAChannel)%len(h.pod.coord)]
		if target != "" {
			conn = h.pod.peer(target)
		}
		sctx, cancel := context.WithCancel(ctx)
		st, err := conn.NewStream(sctx, watchDesc, method, grpc.ForceCodec(raw.Codec{}))
		var in []byte
		if err == nil {
			h.mu.Lock()
			first := opening(h.pod.job, h.rank, h.epoch, h.seq, direct || hop == maxHops)
			h.mu.Unlock()
			err = st.SendMsg(&first)
		}
		if err == nil {
			err = st.RecvMsg(&in)
		}
		if err != nil {
			cancel()
			if target == "" {
				return err
			}
			target, direct = "", true // a relay that failed it: the coordinator serves it
			continue
		}
		ev, err := decodeEvents(in)
		if err != nil {
			cancel()
			return err
		}
		if ev.relayFrom != "" {
			cancel()
			target = ev.relayFrom
			continue
		}
		h.mu.Lock()
		h.stream, h.live = st, true
		again := make([]string, 0, len(h.named)+1)
		for k := range h.named {
			again = append(again, k)
		}
		if !ev.resumed {
			if h.epoch != "" { // the news starts anew: what it waits for is named again
				h.pod.restarted.Add(1)
				clear(h.claimed)
				clear(h.asked)
				if h.waiting != "" && !h.named[h.waiting] {
					again = append(again, h.waiting)
				}
			}
			h.epoch, h.seq = ev.epoch, ev.seq
		}
		clear(h.named)
		h.nameLocked(again)
		if !h.opened {
			h.opened = true
			close(h.openedCh)
		}
		h.mu.Unlock()
		h.cancel = cancel // (the stream's end: follow calls it)
		return nil
	}
	return errors.New("pointed through too many relays")
}

// read takes the stream's messages to its end.
func (h *host) read() error {
	h.mu.Lock()
	st := h.stream
	h.mu.Unlock()
	for {
		var in []byte
		if err := st.RecvMsg(&in); err != nil {
			return err
		}
		ev, err := decodeEvents(in)
		if err != nil {
			return err
		}
		h.take(ev)
	}
}

func (h *host) take(ev events) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if ev.hasSeq {
		h.seq = ev.seq
	}
	for _, k := range ev.claimed {
		h.claimed[k] = true
		delete(h.asked, k)
	}
	for _, k := range ev.ask {
		delete(h.named, k)
		delete(h.claimed, k)
		h.asked[k] = true
	}
	for _, k := range ev.published {
		h.heard[k] = true
		delete(h.named, k)
		delete(h.claimed, k)
	}
	h.pod.turns.Add(int64(len(ev.turns)))
	if h.waiting == "" {
		return
	}
	switch {
	case h.heard[h.waiting]:
		h.end(nil)
	case h.asked[h.waiting]:
		h.end(fmt.Errorf("host %d: told to ask for %s one by one", h.rank, h.waiting))
	default:
		for _, k := range ev.turns {
			if k == h.waiting {
				h.end(fmt.Errorf("host %d: a turn to compile %s came to a leaf", h.rank, k))
			}
		}
	}
}

func (h *host) end(err error) {
	h.waiting = ""
	h.woke <- err
}

// run waits for every program in turn: its end, or why it failed.
func (h *host) run() (time.Time, error) {
	h.woke = make(chan error, 1)
	h.timer = time.AfterFunc(time.Hour, h.nameLate)
	defer h.timer.Stop()
	for _, k := range h.pod.keys {
		h.mu.Lock()
		if h.heard[k] {
			h.mu.Unlock()
			continue
		}
		h.waiting, h.since = k, time.Now()
		if !h.claimed[k] {
			h.timer.Reset(h.pod.nameAfter)
		}
		h.mu.Unlock()
		if err := <-h.woke; err != nil {
			return time.Now(), err
		}
	}
	return time.Now(), nil
}

// nameLate names the key waited for where nobody has claimed it within
// -name-after of the wait's start (the timer is the host's one, set again
// for each wait).
func (h *host) nameLate() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.waiting == "" || !h.live {
		return
	}
	if left := h.pod.nameAfter - time.Since(h.since); left > 0 {
		h.timer.Reset(left)
		return
	}
	h.nameLocked([]string{h.waiting})
}

func main() {
	debug.SetGCPercent(400) // (thousands of hosts' small maps: collected less often)
	target := flag.String("target", "", "the coordinator (host:port)")
	job := flag.String("job", "", "the job")
	ranks := flag.String("ranks", "", "the hosts' ranks: FIRST:LAST (process ids)")
	programs := flag.Int("programs", 0, "the job's programs (keys JOB-progNNNNNN, waited for in turn)")
	nameAfter := flag.Duration("name-after", 3*time.Second, "a key nobody claimed is named upstream after this long (JobStream.NAME_AFTER_S)")
	flag.Parse()
	var first, last int
	if _, err := fmt.Sscanf(*ranks, "%d:%d", &first, &last); err != nil || *target == "" ||
		*job == "" || *programs < 1 || first < 1 || last < first {
		fmt.Fprintln(os.Stderr, "leaves: -target, -job, -ranks FIRST:LAST and -programs >= 1 are required")
		os.Exit(2)
	}
	p := &pod{job: *job, nameAfter: *nameAfter, peers: map[string]*grpc.ClientConn{}}
	for i := 0; i < *programs; i++ {
		p.keys = append(p.keys, fmt.Sprintf("%s-prog%06d", *job, i))
	}
	n := last - first + 1
	for i := 0; i < max(1, n/hostsAChannel); i++ {
		p.coord = append(p.coord, dial(*target))
	}
	ctx, stop := context.WithCancel(context.Background())
	hosts := make([]*host, n)
	gate := make(chan struct{}, opensAtOnce)
	for i := range hosts {
		h := newHost(p, first+i)
		hosts[i] = h
		gate <- struct{}{}
		go h.follow(ctx)
		go func() {
			select {
			case <-h.openedCh:
			case <-time.After(openedWithinS * time.Second):
			}
			<-gate
		}()
	}
	deadline := time.After(openedWithinS * time.Second)
	for _, h := range hosts {
		select {
		case <-h.openedCh:
		case <-deadline:
			fmt.Fprintf(os.Stderr, "leaves: host %d not open within %d s\n", h.rank, openedWithinS)
			os.Exit(1)
		}
	}
	fmt.Println("ready")
	stdin := bufio.NewReader(os.Stdin)
	line, _ := stdin.ReadString('\n')
	if strings.TrimSpace(line) != "go" {
		os.Exit(1) // the bench went away
	}
	cpu0 := raw.CPUSeconds()
	if out := os.Getenv("LEAVES_CPUPROFILE"); out != "" { // where the run's CPU goes
		if f, err := os.Create(out); err == nil {
			_ = pprof.StartCPUProfile(f)
			defer pprof.StopCPUProfile()
		}
	}
	p.reopened.Store(0)
	type result struct {
		end time.Time
		err error
	}
	results := make(chan result, n)
	for _, h := range hosts {
		go func() {
			end, err := h.run()
			results <- result{end, err}
		}()
	}
	var lastEnd time.Time
	var failures []string
	ends := make([]float64, 0, n)
	for range hosts {
		r := <-results
		ends = append(ends, float64(r.end.UnixNano())/1e9)
		if r.err != nil {
			failures = append(failures, r.err.Error())
		}
		if r.end.After(lastEnd) {
			lastEnd = r.end
		}
	}
	cpu := raw.CPUSeconds() - cpu0
	defer stop()
	out, _ := json.Marshal(map[string]any{
		"end": float64(lastEnd.UnixNano()) / 1e9, "failed": len(failures),
		"failures": failures[:min(len(failures), 10)], "named": p.named.Load(),
		"cpu_s": cpu, "reopened": p.reopened.Load(), "restarted": p.restarted.Load(), "turns": p.turns.Load(),
		"hosts": n, "ends": quantiles(ends)})
	fmt.Println(string(out))
	_, _ = stdin.ReadString('\n') // "end": every host of the run is done
}

// quantiles are the ends' first, median, 99th percentile and last.
func quantiles(v []float64) []float64 {
	sort.Float64s(v)
	return []float64{v[0], v[len(v)/2], v[len(v)*99/100], v[len(v)-1]}
}
