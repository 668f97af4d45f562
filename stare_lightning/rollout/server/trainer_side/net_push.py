"""Trainer rank 0's side of a network weight push (``rollout.server.transfer=network``): one two-process gloo group
per server, and the rounds driven through vLLM's RL routes while the chunks' bytes go over those groups.

The groups are set up at the first push: rank 0 hosts a ``TCPStore`` and, for each server at once, joins its group
while the server's worker joins from the other side through the authenticated ``/init_weight_transfer_engine``
route (``net_receive.py``), told the store's address and port, a fresh nonce and its member number; the keys' prefix
comes from the secret (``net_wire.py``). A round is the file backend's: pause, start, one ``update_weights`` per
chunk, its description and digest over HTTP while its bytes go over the group, finish with the version, resume.
The server stages every chunk and swaps only at the finish, so a round cut short leaves it serving what it had.

Every send and every request has the run's request timeout; a failure names the server and ends the run, and a
group that failed is dropped (a later push, after a resume, builds new ones).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from stare_lightning.rollout.server.shared.net_group import TRAINER_RANK, TransferGroup, host_store
from stare_lightning.rollout.server.shared.net_wire import NET_INIT_KEY, new_nonce, rendezvous_prefix
from stare_lightning.rollout.server.trainer_side.client import RolloutServerError, ServerClient

__all__ = ["NetworkPush"]

logger = logging.getLogger(__name__)


class NetworkPush:
    """The groups to ``clients`` (made at the first ``push``), rank 0's store listening on ``address:port`` (port 0:
    a free one)."""

    def __init__(self, clients: Sequence[ServerClient], *, token: str, address: str, port: int, timeout: float):
        self.clients, self.address, self.timeout = list(clients), address, timeout
        self.token, self._port = token, port
        self._store = None
        self._groups: list[TransferGroup] | None = None
        self._new_pools()

    def push(self, chunks: Sequence[tuple[dict, torch.Tensor]], version: str) -> None:
        """One round of ``chunks`` (``net_wire.pack_chunks``) to every server under ``version``."""
        if self._groups is None:
            self._groups = self._connect()
        try:
            self._each(lambda client, group: self._round(client, group, chunks, version))
        except BaseException:
            # What the groups hold is unknown now, and a send may still be blocked in one (until its timeout): the
            # next push builds new groups on new threads.
            self._groups = None
            self.close(keep_store=True)
            self._new_pools()
            raise

    def _new_pools(self) -> None:
        """A driver per server (its HTTP round), and beside it a sender per server (its chunks' bytes, or its side of
        the group's rendezvous). Never waited for at a failure: the run ends with the first."""
        self._drivers = ThreadPoolExecutor(max_workers=len(self.clients), thread_name_prefix="weight-round")
        self._pool = ThreadPoolExecutor(max_workers=len(self.clients), thread_name_prefix="weight-send")

    def _connect(self) -> list[TransferGroup]:
        if self._store is None:
            try:
                self._store = host_store(self.address, self._port, self.timeout)
            except (RuntimeError, OSError) as err:
                raise RolloutServerError(
                    f"the weight push cannot listen on {self.address}:{self._port} "
                    f"(rollout.server.transfer_address, transfer_port): {err}"
                ) from None
        nonce, port = new_nonce(), self._store.port
        groups: list[TransferGroup | None] = [None] * len(self.clients)

        def join(member: int) -> None:
            prefix = rendezvous_prefix(self.token, nonce, member)
            groups[member] = TransferGroup(self._store, prefix, TRAINER_RANK, self.address, self.timeout)

        def init(client: ServerClient, member: int) -> None:
            joining = self._pool.submit(join, member)
            init_info = {"address": self.address, "port": port, "nonce": nonce, "member": member}
            client.init_transfer({NET_INIT_KEY: {**init_info, "timeout_s": self.timeout}})
            self._wait(joining, client, "joining its weight-transfer group")

        futures = [(client, self._drivers.submit(init, client, m)) for m, client in enumerate(self.clients)]
        for client, future in futures:
            self._wait(future, client, "setting up its network weight push")
        logger.info(
            "weights go to %d rollout server(s) over the network (gloo, rendezvous at %s:%d)",
            len(self.clients),
            self.address,
            port,
        )
        return groups  # type: ignore[return-value]

    def _round(self, client: ServerClient, group: TransferGroup, chunks, version: str) -> None:
        client.begin_push()
        sending = self._pool.submit(_send_all, group, [buffer for _, buffer in chunks])
        for info, _ in chunks:
            client.send_chunk(info)  # returns once the server has received and checked the chunk's bytes
        self._wait(sending, client, "receiving the weights")
        client.end_push(version)

    def _each(self, call: Callable[[ServerClient, TransferGroup], None]) -> None:
        """``call`` for every server at once; the first failure, naming its server, stops the run."""
        assert self._groups is not None
        futures = [(c, self._drivers.submit(call, c, g)) for c, g in zip(self.clients, self._groups)]
        for client, future in futures:
            self._wait(future, client, "its weight round")

    def _wait(self, future: Future, client: ServerClient, what: str) -> None:
        try:
            future.result()
        except RolloutServerError:
            raise
        except (RuntimeError, OSError) as err:  # gloo and the store raise RuntimeErrors, a timeout among them
            raise RolloutServerError(
                f"rollout server {client.url}: {what} over the network failed within {self.timeout:g} s "
                f"(rollout.server.request_timeout): {str(err).splitlines()[0] if str(err) else type(err).__name__}"
            ) from None

    def close(self, keep_store: bool = False) -> None:
        self._groups = None
        if not keep_store:
            self._store = None
        for pool in (self._drivers, self._pool):
            pool.shutdown(wait=False, cancel_futures=True)


def _send_all(group: TransferGroup, buffers: list[torch.Tensor]) -> None:
    for buffer in buffers:
        if buffer.numel():  # the server receives nothing for a chunk of empty tensors either
            group.send(buffer)
