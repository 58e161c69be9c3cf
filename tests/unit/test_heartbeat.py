"""Heartbeats in a real TCP store (the kind the process group's rendezvous runs): a rank whose
beats stop is named silent with its node; a rank that exited is not."""

from __future__ import annotations

import threading
from datetime import timedelta

from torch.distributed import TCPStore

from pyrecover import heartbeat
from pyrecover.spawn import free_port


def test_a_rank_whose_heartbeat_stops_is_named_silent_and_one_that_exited_is_not():
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10),
                      wait_for_workers=False)
    nodes = ["nodeA", "nodeB", "nodeC", "nodeB"]
    beats = [heartbeat.Heartbeat(heartbeat.connect("127.0.0.1", port), rank, 4, node,
                                 every_s=0.05).start() for rank, node in enumerate(nodes)]
    beats[1]._stop.set()  # as a SIGSTOP would: the thread stops, no `exit` is written
    beats[1]._thread.join()
    beats[2].stop()  # left the job after, say, reporting the hang itself

    found = beats[0].silent()
    assert found == heartbeat.Silence([1], ["nodeB"]) and found.node == "nodeB"
    beats[3]._stop.set()
    beats[3]._thread.join()
    both = beats[0].silent()
    assert both.ranks == [1, 3] and both.node == "nodeB"  # both silent ranks on one node
    beats[1].stop()  # they exit after all: each writes `exit`
    beats[3].stop()
    assert beats[0].silent() == heartbeat.Silence([], [])  # (its own beats still count)
    beats[0].stop()
    del server


def test_silent_ranks_on_two_nodes_name_no_single_node():
    assert heartbeat.Silence([1, 5], ["n1", "n2"]).node is None
    assert heartbeat.Silence([], []).node is None


def test_no_store_means_no_heartbeat_and_no_error():
    port = free_port()  # nobody listens there
    done = threading.Event()
    result: list = []

    def call() -> None:
        result.append(heartbeat.start("127.0.0.1", port, 1, 2, "n1"))
        done.set()

    threading.Thread(target=call, daemon=True).start()
    assert done.wait(60) and result == [None]
