#!/usr/bin/env python3
"""A TCP relay that can add latency and loss-like stalls, for scripts/ci/chaos.sh where the
kernel has no `netem` qdisc (some VMs and sandboxes ship without sch_netem).

    chaos_proxy.py LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT CONTROL_FILE SEED

Every accepted connection is relayed to the target, both ways. While CONTROL_FILE holds
`lossy`, each chunk read is delivered 200 ms +- 50 ms (normal) later, in order, and with
probability 5% it is held a further 200 ms to 1 s, what a lost segment costs TCP until its
retransmission arrives (a relay above TCP cannot drop bytes without breaking the stream, so
loss is emulated by its effect). Any other content (or no file) relays at once.
"""

import asyncio
import random
import sys
import time

MODE = {"lossy": False}


async def watch(control):
    while True:
        try:
            with open(control) as f:
                MODE["lossy"] = f.read().strip() == "lossy"
        except OSError:
            MODE["lossy"] = False
        await asyncio.sleep(0.1)


async def pipe(reader, writer, rng):
    queue = asyncio.Queue()

    async def pump():
        last = 0.0
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                now = time.monotonic()
                delay = 0.0
                if MODE["lossy"]:
                    delay = max(0.0, rng.gauss(0.2, 0.05))
                    if rng.random() < 0.05:
                        delay += rng.uniform(0.2, 1.0)
                last = max(last, now + delay)
                await queue.put((last, data))
        except (ConnectionError, OSError):
            pass
        await queue.put(None)

    async def deliver():
        try:
            while True:
                item = await queue.get()
                if item is None:
                    break
                at, data = item
                wait = at - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    await asyncio.gather(pump(), deliver())


async def main(listen_host, listen_port, target_host, target_port, control, seed):
    rng = random.Random(seed)
    asyncio.get_running_loop().create_task(watch(control))

    async def handle(client_reader, client_writer):
        try:
            server_reader, server_writer = await asyncio.open_connection(target_host, target_port)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(pipe(client_reader, server_writer, rng),
                             pipe(server_reader, client_writer, rng))

    server = await asyncio.start_server(handle, listen_host, listen_port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    if len(sys.argv) != 7:
        sys.exit(__doc__)
    h, p, th, tp, control, seed = sys.argv[1:]
    asyncio.run(main(h, int(p), th, int(tp), control, int(seed)))
