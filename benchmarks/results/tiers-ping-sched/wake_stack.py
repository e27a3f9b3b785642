"""How long a woken process waits when its waker keeps its CPU busy afterwards (a one-off
diagnostic of this machine's scheduler, no shmkv code).

    python wake_stack.py

Two processes: every millisecond a server sends 8 bytes to a client over a socket pair
and then computes for 300 us (as the coordinator's loop does after an answer when it has
more work); the client waits in ``poll`` and stamps how long after the send it runs. The
wake-up is made two ways: by the socket itself (a "sync" wake-up, which asks the kernel
to put the client on the waker's CPU), and by an eventfd written after the bytes (a plain
wake-up; the client polls the eventfd only). A client put on the busy waker's CPU waits
for the 300 us; the other CPU is idle throughout.
"""

import multiprocessing as mp
import os
import select
import socket
import struct
import time

N = 3000
BUSY_S = 300e-6


def server(sock, efd, mode):
    for _ in range(N):
        time.sleep(0.001)
        sock.send(struct.pack("d", time.monotonic()))
        if mode == "eventfd":
            os.eventfd_write(efd, 1)
        end = time.monotonic() + BUSY_S
        while time.monotonic() < end:
            pass


def client(sock, efd, mode, queue):
    poller = select.poll()
    poller.register(sock if mode == "socket" else efd, select.POLLIN)
    lat = []
    for _ in range(N):
        poller.poll(1000)
        if mode == "eventfd":
            os.eventfd_read(efd)
        (sent,) = struct.unpack("d", sock.recv(8))
        lat.append(time.monotonic() - sent)
    lat.sort()
    late = sum(x > BUSY_S / 2 for x in lat) / len(lat)
    queue.put((lat[len(lat) // 2], lat[int(len(lat) * 0.9)], lat[int(len(lat) * 0.99)], late))


def main():
    ctx = mp.get_context("fork")
    for _ in range(2):
        for mode in ("socket", "eventfd"):
            ours, theirs = socket.socketpair()
            efd = os.eventfd(0)
            queue = ctx.Queue()
            proc = ctx.Process(target=client, args=(theirs, efd, mode, queue))
            proc.start()
            time.sleep(0.2)
            server(ours, efd, mode)
            p50, p90, p99, late = queue.get(timeout=60)
            proc.join(10)
            print(
                f"{mode:8s} send to client running: p50 {p50 * 1e6:5.0f} p90 {p90 * 1e6:5.0f} "
                f"p99 {p99 * 1e6:5.0f} us; {100 * late:.1f}% waited for the busy waker"
            )
            for s in (ours, theirs):
                s.close()
            os.close(efd)


if __name__ == "__main__":
    main()
