#!/usr/bin/env python3
"""Reproduces the Redis 8.6 `SET … IFEQ` fault of docs/redis-8-set-ifeq.md with plain
commands (no client library, no code of the store's).

Starts a server of its own on PORT (a loopback port, `--maxmemory 4mb`, `noeviction`),
loads the store's function library (read from protocol.rs) and, per trial, does what the
test `a_full_redis_8_keeps_keys_locked_until_their_commits_land` does to its server: three
in-flight records (`SET … NX PX 1000 GET`), renewed every 300 ms by the library's `renew`
on another thread, Redis filled to `maxmemory` and held there (`CONFIG SET maxmemory 3mb`),
commits refused (`OOM`) for a while, `begin`s of new tokens refused, the fillers deleted,
then the three commits in one pipeline. A trial fails when a commit's reply or a key's
value afterwards is not what the command asked for.

    SERVER=/opt/redis-8.6/bin/redis-server python3 docs/redis-8-set-ifeq.py 7601          # by SET … IFEQ
    SERVER=/opt/redis-8.6/bin/redis-server COMMIT=fcall python3 docs/redis-8-set-ifeq.py 7602
    SERVER=valkey-server python3 docs/redis-8-set-ifeq.py 7603

ONE_BY_ONE=1 sends the three final commits one round trip each instead of in one pipeline;
NO_RENEW=1 writes the in-flight records without a lease and renews nothing (no Lua, no
TTL).
"""
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time

PORT = int(sys.argv[1]) if len(sys.argv) > 1 else 7601
SERVER = os.environ.get("SERVER", "/opt/redis-8.6/bin/redis-server")
COMMIT = os.environ.get("COMMIT", "ifeq")
TRIALS = int(os.environ.get("TRIALS", "30"))
NO_RENEW = bool(os.environ.get("NO_RENEW"))
HERE = os.path.dirname(os.path.abspath(__file__))
PROTOCOL = os.path.join(HERE, "..", "idempotency-actix", "src", "store", "redis", "protocol.rs")
LIBRARY = re.search(r'pub\(crate\) const LIBRARY: &str = r"(.*?)";\n', open(PROTOCOL).read(), re.S).group(1)


def encode(*args):
    out = b"*%d\r\n" % len(args)
    for arg in args:
        arg = arg if isinstance(arg, bytes) else str(arg).encode()
        out += b"$%d\r\n%s\r\n" % (len(arg), arg)
    return out


class Connection:
    def __init__(self):
        self.socket = socket.create_connection(("127.0.0.1", PORT))
        self.buffer = b""

    def _line(self):
        while b"\r\n" not in self.buffer:
            self.buffer += self.socket.recv(65536)
        line, self.buffer = self.buffer.split(b"\r\n", 1)
        return line

    def _bytes(self, count):
        while len(self.buffer) < count + 2:
            self.buffer += self.socket.recv(65536)
        data, self.buffer = self.buffer[:count], self.buffer[count + 2:]
        return data

    def reply(self):
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return Exception(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            return None if int(rest) < 0 else self._bytes(int(rest))
        if kind == b"*":
            return None if int(rest) < 0 else [self.reply() for _ in range(int(rest))]
        raise ValueError(line)

    def command(self, *args):
        self.socket.sendall(encode(*args))
        return self.reply()

    def pipeline(self, commands):
        self.socket.sendall(b"".join(encode(*command) for command in commands))
        return [self.reply() for _ in commands]


def commits(keys, completed, in_flight):
    if COMMIT == "fcall":
        return [("FCALL", "idempotency_actix_2_r9_commit", 1, k, i, c, 86400000)
                for k, c, i in zip(keys, completed, in_flight)]
    return [("SET", k, c, "IFEQ", i, "PX", 86400000) for k, c, i in zip(keys, completed, in_flight)]


def trial(number):
    store, test = Connection(), Connection()
    store.command("FLUSHALL")
    store.command("CONFIG", "SET", "maxmemory", "4mb")
    store.command("FUNCTION", "LOAD", "REPLACE", LIBRARY)
    fingerprint = bytes(random.getrandbits(8) for _ in range(32))
    keys = ["idempotency:%064x" % random.getrandbits(256) for _ in range(3)]
    tokens = ["%032x" % random.getrandbits(128) for _ in range(3)]
    in_flight = [b"\x02i" + fingerprint + b" " + token.encode() for token in tokens]
    completed = [b"\x02c" + fingerprint + b" " + token.encode() + b"\x00" * 20
                 + b'{"slow":%d}' % (index + 1) for index, token in enumerate(tokens)]
    for key, record in zip(keys, in_flight):
        lease = [] if NO_RENEW else ["PX", 1000]
        assert store.command("SET", key, record, "NX", *lease, "GET") is None
    lock, stop = threading.Lock(), threading.Event()

    def renew():
        while not stop.is_set():
            for key, token in zip(keys, tokens):
                with lock:
                    store.command("FCALL", "idempotency_actix_2_r9_renew", 1, key, " " + token, 1000)
            time.sleep(0.3)

    renewals = threading.Thread(target=renew)
    if not NO_RENEW:
        renewals.start()
    fillers = []
    for size in (16384, 1024, 64):
        value = b"f" * size
        for index in range(10000):
            name = "filler:%d:%d" % (size, index)
            if isinstance(test.command("SET", name, value), Exception):
                break
            fillers.append(name)
    test.command("CONFIG", "SET", "maxmemory", "3mb")
    for _ in range(8):
        with lock:
            refused = store.pipeline(commits(keys, completed, in_flight))
        assert all(isinstance(reply, Exception) for reply in refused), refused
        time.sleep(0.1)
    with lock:
        for key in keys + ["idempotency:new"]:
            token = ("%032x" % random.getrandbits(128)).encode()
            store.command("SET", key, b"\x02i" + fingerprint + b" " + token, "NX", "PX", 1000, "GET")
            store.command("GET", key)
    test.command("DEL", *fillers)
    with lock:
        if os.environ.get("ONE_BY_ONE"):
            replies = [store.pipeline([c])[0] for c in commits(keys, completed, in_flight)]
        else:
            replies = store.pipeline(commits(keys, completed, in_flight))
    stop.set()
    if not NO_RENEW:
        renewals.join()
    found = [test.command("GET", key) for key in keys]
    wrong = [index for index in range(3) if found[index] != completed[index]]
    if not wrong:
        return True
    print("trial", number, "commit replies", replies)
    for index in range(3):
        print("  key", index, "written", completed[index][-10:], "holds", (found[index] or b"")[-60:])
    return False


server = subprocess.Popen([SERVER, "--port", str(PORT), "--bind", "127.0.0.1", "--save", "",
                           "--appendonly", "no", "--maxmemory", "4mb",
                           "--maxmemory-policy", "noeviction"], stdout=subprocess.DEVNULL)
time.sleep(0.5)
try:
    failed = sum(0 if trial(number) else 1 for number in range(TRIALS))
    print("%s, commits by %s: %d of %d trials wrong" % (SERVER, COMMIT, failed, TRIALS))
finally:
    server.kill()
