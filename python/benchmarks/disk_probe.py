"""Disk probe (issue 7): how the write pattern alone changes durable throughput on this disk.

Writes 1.5 GiB from memory four ways, 3 runs each, interleaved, medians: one sequential stream, the
same after posix_fallocate of the whole file, two threads of 8 MiB pwrites, and the same after
posix_fallocate (the pattern of src/writer.rs + storage::DataFile). Every case ends with fdatasync.

Run: python python/benchmarks/disk_probe.py /tmp/probe
"""
import os, time, threading, sys
import numpy as np
N = 3 << 29
buf = np.random.randint(0, 255, N, dtype=np.uint8)
mv = memoryview(buf)
d = sys.argv[1]; os.makedirs(d, exist_ok=True)
def seq(path, falloc):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    if falloc: os.posix_fallocate(fd, 0, N)
    m = mv
    while m: m = m[os.write(fd, m[:1 << 30]):]
    os.fdatasync(fd); os.close(fd)
def par(path, falloc, threads=2, block=8 << 20):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    if falloc: os.posix_fallocate(fd, 0, N)
    offs = list(range(0, N, block)); lock = threading.Lock()
    def w():
        while True:
            with lock:
                if not offs: return
                o = offs.pop(0)
            os.pwrite(fd, mv[o:o + block], o)
    ts = [threading.Thread(target=w) for _ in range(threads)]
    [t.start() for t in ts]; [t.join() for t in ts]
    os.fdatasync(fd); os.close(fd)
cases = {"seq": lambda p: seq(p, False), "seq+fallocate": lambda p: seq(p, True),
         "2 threads 8 MiB pwrite": lambda p: par(p, False), "2 threads + fallocate": lambda p: par(p, True)}
res = {k: [] for k in cases}
for rep in range(3):
    for k, f in cases.items():
        p = os.path.join(d, "probe.bin")
        t = time.monotonic(); f(p); res[k].append(time.monotonic() - t); os.unlink(p)
for k, v in res.items():
    v.sort(); print(f"{k:28s} median {v[1]:.2f} s  {N / v[1] / 1e9:.2f} GB/s  runs {[round(x, 2) for x in v]}")
