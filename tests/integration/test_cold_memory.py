"""The node's cold-memory reclaimer (docs/qos.md): memory of sandboxes nobody used for their class's age goes to swap.

The module's dsecd runs with a swap file of its own and `--reclaim-age 4` (standard sandboxes after 4 s unused,
batch after 1 s, latency never). A sandbox runs memhold (benchmarks/programs/memhold.c), which holds pseudo-random
anonymous memory, keeps its checksum and raises a counter every 50 ms (so its process runs throughout). Reading its
info does not count as use; an exec or a file read does. Checked: an idle holder's memory leaves RAM for swap and
reads back intact (its refaults counted), the metrics and the node's total say so; a latency sandbox and one made
with reclaim=False keep theirs; a sandbox in use is left alone; one already at its floor is not stopped again for
nothing; batch goes first.

Skips, with the reason, where this host does not let root turn swap on."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

import dsec_testlib as lib
from test_sleep_swap import Holder, active_swaps, charged, in_swap, memhold_home, start_agent

dsec = lib.dsec

MiB = 1 << 20
HOLD_MIB = 96
AGE = 4


@pytest.fixture(scope="module")
def cold_home():
    yield from memhold_home("dsec-it-cold-")


@pytest.fixture(scope="module")
def cold_agent(cold_home):
    swap_file = os.path.join(cold_home, "swap", "swapfile")
    agent = lib.Agent(cold_home, tag="cold", extra_args=["--swap-file", swap_file, "--swap-size", "512Mi",
                                                         "--reclaim-age", str(AGE)])
    start_agent(agent)
    try:
        yield agent
    finally:
        agent.stop()
        still_on = swap_file in active_swaps()
        if still_on:
            subprocess.run(["swapoff", swap_file], check=False)
        agent.stop_and_check([f"its swap file is still on: {swap_file}"] if still_on else [])


@pytest.fixture(scope="module")
def cclient(cold_agent):
    c = dsec.Client(endpoints=[cold_agent.endpoint])
    yield c
    c.close()


def reclaims(sb) -> int:
    return sb.info().cold_memory.reclaims  # info() is not a use


def wait_reclaimed(agent, sb, below: int, timeout: float = 60) -> float:
    """Waits until the sandbox's charge is under `below` bytes; returns how long that took."""
    t0 = time.monotonic()
    # The charge falls during the reclaim; the sandbox's info counts it once the reclaim is over.
    assert lib.wait_for(lambda: charged(agent, sb.id) < below and reclaims(sb) >= 1, timeout, interval=0.25), \
        (charged(agent, sb.id), sb.info().cold_memory.reclaims)
    return time.monotonic() - t0


def test_an_idle_sandbox_gives_its_memory_to_swap_and_gets_it_back(cold_agent, cold_home, cclient):
    node = cclient.nodes()[0]
    assert node.qos.reclaim == "idle", node.qos.reclaim_reason
    sb = cclient.create("busybox", memory="256Mi", ttl=600)
    try:
        hold = Holder(sb, cold_home, HOLD_MIB)
        before = charged(cold_agent, sb.id)
        assert before >= HOLD_MIB * MiB
        took = wait_reclaimed(cold_agent, sb, before - (HOLD_MIB * MiB) * 8 // 10)
        info = sb.info().cold_memory
        assert info.reclaims >= 1 and info.reclaimed_bytes >= HOLD_MIB * MiB // 2, info
        assert info.last_reclaim_at > 0
        assert in_swap(cold_agent, sb.id) >= HOLD_MIB * MiB * 7 // 10
        print(f"\n{HOLD_MIB} MiB holder, idle: {before / MiB:.0f} MiB -> {charged(cold_agent, sb.id) / MiB:.0f} MiB "
              f"charged within {took:.1f} s, {info.reclaims} reclaims")
        # Idle at its floor, it is not stopped again for nothing when its age comes round once more.
        done = reclaims(sb)
        time.sleep(AGE + 1.5)
        assert reclaims(sb) == done, sb.info().cold_memory
        # Its process ran on throughout (a reclaim stops it for a moment only).
        counted = hold.count()
        time.sleep(0.5)
        assert hold.count() > counted
        # Everything reads back, intact; the kernel counted the pages that came back.
        verdict = hold.check()
        assert verdict.startswith("ok " + hold.sum), (verdict, hold.sum)
        assert sb.info().cold_memory.refaults > 0
        metrics = lib.http_request(cold_agent.socket_path, "GET", "/metrics").body.decode()
        assert f'dsec_sandbox_reclaimed_bytes_total{{sandbox="{sb.id}"}}' in metrics
        assert f'dsec_sandbox_refaults_total{{sandbox="{sb.id}"}}' in metrics
        assert cclient.nodes()[0].qos.reclaimed_bytes >= info.reclaimed_bytes
    finally:
        sb.destroy()


def test_latency_and_opted_out_sandboxes_keep_their_memory(cold_agent, cold_home, cclient):
    latency = cclient.create("busybox", memory="192Mi", ttl=600, priority="latency")
    kept = cclient.create("busybox", memory="192Mi", ttl=600, reclaim=False)
    standard = cclient.create("busybox", memory="192Mi", ttl=600)
    try:
        holders = {sb.id: Holder(sb, cold_home, 48) for sb in (latency, kept, standard)}
        assert kept.info().resources.reclaim is False
        wait_reclaimed(cold_agent, standard, 24 * MiB)
        time.sleep(2)  # two more rounds
        for sb in (latency, kept):
            assert reclaims(sb) == 0, sb.info().cold_memory
            assert charged(cold_agent, sb.id) >= 48 * MiB
            assert in_swap(cold_agent, sb.id) == 0
        assert holders[latency.id].check().startswith("ok")
    finally:
        for sb in (latency, kept, standard):
            sb.destroy()


def test_a_sandbox_in_use_is_left_alone(cold_agent, cold_home, cclient):
    sb = cclient.create("busybox", memory="192Mi", ttl=600)
    try:
        Holder(sb, cold_home, 48)
        end = time.monotonic() + AGE * 2.5
        while time.monotonic() < end:
            assert sb.exec("true").exit_code == 0  # a step of the agent loop every half second
            time.sleep(0.5)
        assert reclaims(sb) == 0, sb.info().cold_memory
        assert in_swap(cold_agent, sb.id) == 0
        # Once the loop stops, its turn comes.
        wait_reclaimed(cold_agent, sb, 24 * MiB)
    finally:
        sb.destroy()


def test_batch_goes_before_standard(cold_agent, cold_home, cclient):
    standard = cclient.create("busybox", memory="192Mi", ttl=600)
    batch = cclient.create("busybox", memory="192Mi", ttl=600, priority="batch")
    try:
        Holder(standard, cold_home, 32)
        Holder(batch, cold_home, 32)
        t0 = time.monotonic()
        assert lib.wait_for(lambda: reclaims(batch) >= 1, 30, interval=0.1)
        assert time.monotonic() - t0 < AGE - 1, "batch waited as long as standard"
        assert reclaims(standard) == 0
        assert lib.wait_for(lambda: reclaims(standard) >= 1, 30, interval=0.2)
    finally:
        standard.destroy()
        batch.destroy()
