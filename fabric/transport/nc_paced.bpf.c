// SPDX-License-Identifier: GPL-2.0
/*
 * nc_paced: a TCP congestion control for the hub's bulk connections that only follows the
 * pacing rate it is given (SO_MAX_PACING_RATE, which the spoke's own BBR controller sets
 * through PacingLimit). It keeps no model of its own: no PROBE_RTT, no window cut on loss,
 * no start-up of its own once a rate is given. Its window is twice the rate times the
 * connection's smoothed RTT, and it paces at the rate. Until a rate is given it is a plain
 * loss-based slow start, so that a client that never gives one cannot flood the path. The
 * kernel still retransmits what is lost (SACK, RACK, RTO); only the rate is ours. See
 * fabric/transport/kernel_cc.py and docs/transport.md ("nc_paced: a kernel congestion control
 * that follows our pacing").
 *
 * Built against the running kernel's BTF (vmlinux.h from bpftool) and registered as a
 * struct_ops map. GPL-2.0, unlike the rest of the project (Apache-2.0): the kernel lets only
 * GPL-compatible programs implement a TCP congestion control.
 */
#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

char _license[] SEC("license") = "GPL";

#define USEC_PER_SEC 1000000ULL
/* SO_MAX_PACING_RATE's "no cap" (~0UL): the spoke has not given a rate yet. */
#define NO_CAP (~0UL)
/* Window over the rate times the smoothed round trip: room for delayed and stretched ACKs, as
 * BBR's cwnd_gain of 2. The smoothed RTT, not the minimum, so that with a queue ahead of the
 * flow or a receiver slow to ACK (loopback) the rate, not the window, stays the limit. */
#define CWND_GAIN 2
/* Segments in flight at least: the kernel's initial window. */
#define MIN_CWND 10
/* Pacing over the window per round trip before a rate is given: slow start's 200 %. */
#define SLOW_START_PACING_GAIN 2

static inline struct tcp_sock *tcp_sk(const struct sock *sk)
{
	return (struct tcp_sock *)sk;
}

SEC("struct_ops")
void BPF_PROG(nc_paced_init, struct sock *sk)
{
	/* TCP's own pacing (no fq qdisc needed), at sk_pacing_rate set below. */
	sk->sk_pacing_status = SK_PACING_NEEDED;
}

SEC("struct_ops")
void BPF_PROG(nc_paced_cong_control, struct sock *sk, __u32 ack, int flag,
	      const struct rate_sample *rs)
{
	struct tcp_sock *tp = tcp_sk(sk);
	unsigned long cap = sk->sk_max_pacing_rate;
	__u64 mss = tp->mss_cache ? tp->mss_cache : 1;
	__u64 srtt = tp->srtt_us >> 3;
	__u64 cwnd;

	if (!srtt)
		srtt = 1;
	if (cap == NO_CAP && rs->losses > 0)
		/* No rate given (the first round trip, or a client that never gives one): a
		 * loss-based window, halved on every ACK that marks segments lost. */
		cwnd = tp->snd_cwnd / 2;
	else if (cap == NO_CAP)  /* ... and grown by what is acknowledged, as slow start does */
		cwnd = (__u64)tp->snd_cwnd + rs->acked_sacked;
	else
		cwnd = CWND_GAIN * (__u64)cap * srtt / USEC_PER_SEC / mss;
	if (cwnd < MIN_CWND)
		cwnd = MIN_CWND;
	if (cwnd > tp->snd_cwnd_clamp)
		cwnd = tp->snd_cwnd_clamp;
	tp->snd_cwnd = cwnd;
	if (cap == NO_CAP)
		sk->sk_pacing_rate = SLOW_START_PACING_GAIN * cwnd * mss * USEC_PER_SEC / srtt;
	else
		sk->sk_pacing_rate = cap;
}

/* With a rate given, loss changes nothing: the threshold and the window stay as they are (a
 * retransmission timeout sets the window to the packets in flight until the next ACK). */
SEC("struct_ops")
__u32 BPF_PROG(nc_paced_ssthresh, struct sock *sk)
{
	return tcp_sk(sk)->snd_ssthresh;
}

SEC("struct_ops")
__u32 BPF_PROG(nc_paced_undo_cwnd, struct sock *sk)
{
	return tcp_sk(sk)->snd_cwnd;
}

SEC(".struct_ops")
struct tcp_congestion_ops nc_paced = {
	.init = (void *)nc_paced_init,
	.cong_control = (void *)nc_paced_cong_control,
	.ssthresh = (void *)nc_paced_ssthresh,
	.undo_cwnd = (void *)nc_paced_undo_cwnd,
	.name = "nc_paced",
};
