"""Peer wire protocol: length-prefixed frames with an HMAC-authenticated fixed header.

A connection starts with the server's challenge (magic + 16-byte nonce). The client answers
with a HELLO frame whose payload is its own nonce and the job name. Every frame header then
carries a direction, a per-direction sequence number and an HMAC-SHA256 over
(both nonces, direction, header fields) keyed with the job token, so a peer without the token
(another job, or nobody) cannot open a session, and frames cannot be replayed or reordered.

Every payload is followed by a 16-byte AES-256-GMAC tag (the GCM tag of an empty message
whose associated data is the payload) under a one-time key derived from the token, both
nonces, the direction and the frame's sequence number (HMAC-SHA256): a keyed MAC over each
chunk, so bytes changed on the path are refused even when their CRC-32 still matches. GMAC
(AES-NI and carry-less multiplication, through OpenSSL) ran at 8.3 GiB/s on the 2-core
development machine against Poly1305's 5.5, and unlike Poly1305 it releases the GIL: bulk
payloads are tagged (and, on the receiving end, decrypted and CRC-checked) piece by piece on
a helper thread, in order, while the moving thread sends or receives the next piece. The
CRC-32s stay: they are what the trainer's slot header, the replica store and S3 keep
(checksum.py).

Optional encryption (GEMINI_PEER_ENCRYPTION=on, spec.checkpoint.peerEncryption): the HELLO
and WELCOME then carry ephemeral X25519 public keys (authenticated like every frame), and
every payload after the handshake is encrypted with AES-256-CTR under a one-time key derived
from the token and the connection's shared secret (forward secrecy: a token learnt later does
not open recorded traffic); the GMAC tag is then over the ciphertext (encrypt-then-MAC).
A server that requires it refuses a client that does not encrypt, with an ERROR saying so;
one that does not require it still accepts encrypted clients. Headers (rank, version, offset,
lengths, checksums) and the job name stay readable. TLS was not used: Python's ssl has no
pre-shared keys (a CA and a certificate per pod), and its sockets cannot move bulk payloads
on the duplicate socket of a worker thread while the event loop reads acknowledgements.

This module holds the connection (``Channel``: the handshake, frames and payloads); the frame
format and header MAC are in peer_frames, the keys, tags, cipher and key agreement in
peer_keys, the threads and socket settings of bulk payloads in peer_bulk.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import socket

from gemini_sidecar.checksum import crc32
from gemini_sidecar.peer_bulk import (
    BULK_BYTES,
    BULK_TIMEOUT_S,
    CLIENT_POOLS,
    CRC_PIECE_BYTES,
    ChannelPools,
    InOrder,
    watch_for_silence,
)
from gemini_sidecar.peer_frames import (
    CHALLENGE_BYTES,
    CHALLENGE_MAGIC,
    CLIENT_TO_SERVER,
    FIELDS,
    FLAG_ENCRYPT,
    HEADER_BYTES,
    MAX_JOB_NAME_BYTES,
    NONCE_BYTES,
    PLAINTEXT_REFUSED,
    PUBLIC_KEY_BYTES,
    SERVER_TO_CLIENT,
    TAG_BYTES,
    AuthError,
    ChecksumMismatch,
    Frame,
    FrameType,
    PayloadTampered,
    PeerRefused,
    ProtocolError,
    ReadTimeout,
    pack_fields,
    unpack_header,
    wire_payload_bytes,
)
from gemini_sidecar.peer_keys import PayloadCipher, PayloadTag, SessionKeys, new_key_pair


class Channel:
    """One authenticated connection over a non-blocking socket.

    Headers and small frames go through the event loop. Large payloads are sent from and
    received straight into caller memory (no copies) by a worker thread, on a duplicate of
    the socket with a timeout: its sendall/recv_into loops then run in C with the GIL
    released, like a plain blocking transfer, instead of waking the event loop for every
    few hundred kilobytes. The duplicate shares the socket's non-blocking file status, so the
    event loop can read acknowledgements on the original at the same time.

    One task sends and one task receives at a time (sends are awaited in order).

    `read_timeout` (servers): once a frame has started, its header and small payloads must
    arrive within it; waiting for the next frame is not limited (an authenticated peer keeps
    its connection between versions). A bulk payload fails after `bulk_timeout` without a byte.
    `encrypt`: a client asks for encrypted payloads; a server requires them.
    Raises OSError (no file descriptor left for the duplicate); the caller closes `sock`.
    """

    def __init__(self, sock: socket.socket, token: bytes, max_payload: int, server: bool,
                 pools: ChannelPools = CLIENT_POOLS, read_timeout: float | None = None,
                 bulk_timeout: float = BULK_TIMEOUT_S, peer: str = "",
                 encrypt: bool = False) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):  # acks must not wait for Nagle
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            watch_for_silence(sock)
        self.sock = sock
        self.peer = peer  # the peer's address, for logs
        # rank -> the version whose transfer this connection began last (a server writes
        # only those)
        self.began: dict[int, int] = {}
        self._bulk = sock.dup()
        self._bulk.settimeout(bulk_timeout)
        self._pools = pools
        self._read_timeout = read_timeout
        self._keys = SessionKeys(token)
        self._max_payload = max_payload
        self._send_dir = SERVER_TO_CLIENT if server else CLIENT_TO_SERVER
        self._recv_dir = 1 - self._send_dir
        self._encrypt = encrypt
        self._send_seq = 0
        self._recv_seq = 0
        self._loop = asyncio.get_running_loop()

    async def _recv_exact(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = await self._loop.sock_recv_into(self.sock, view[got:])
            if n == 0:
                raise ConnectionError("peer closed the connection mid-frame")
            got += n

    async def _recv_within(self, view: memoryview) -> None:
        """`_recv_exact` within the read timeout (when there is one)."""
        if self._read_timeout is None:
            await self._recv_exact(view)
            return
        try:
            await asyncio.wait_for(self._recv_exact(view), self._read_timeout)
        except TimeoutError as err:
            raise ReadTimeout(f"{len(view)} bytes did not arrive within "
                              f"{self._read_timeout:g} s (GEMINI_READ_TIMEOUT_S)") from err

    async def recv_bytes(self, count: int) -> bytes:
        buf = bytearray(count)
        await self._recv_within(memoryview(buf))
        return bytes(buf)

    def seal(self, frame: Frame) -> bytes:
        """The authenticated header of `frame` as the next frame sent (the caller sends it)."""
        fields = pack_fields(frame, self._send_seq)
        self._send_seq += 1
        return fields + self._keys.header_mac(self._send_dir, fields)

    @property
    def encrypted(self) -> bool:
        """Whether payloads on this connection are encrypted (known after the handshake)."""
        return self._keys.encrypted

    async def send(self, frame: Frame, payload: memoryview | bytes | None = None) -> None:
        """Send `frame`, and its payload (exactly `frame.length` bytes) with its tag."""
        size = 0 if payload is None else len(payload)
        if payload is not None and size != frame.length:
            raise ValueError(f"{frame.type.name} says {frame.length} payload bytes, got {size}")
        key = self._keys.payload_key(self._send_dir, self._send_seq)
        cipher = self._keys.cipher(self._send_dir, self._send_seq)
        head = self.seal(frame)
        if payload is None or not size:
            await self._loop.sock_sendall(self.sock, head)
        elif size < BULK_BYTES:  # small: one tag call holds the GIL for microseconds
            body = bytes(payload) if cipher is None else cipher.update(payload)
            tag = PayloadTag.of(key, body)
            await self._loop.sock_sendall(self.sock, head + body + tag)
        else:
            await self._loop.run_in_executor(self._pools.send, self._send_bulk, head, payload,
                                             key, cipher)

    def _send_bulk(self, head: bytes, payload: memoryview | bytes, key: bytes,
                   cipher: PayloadCipher | None) -> None:
        """Send head, payload and tag. Each piece is tagged on a helper thread once it went
        into the socket buffer, while this thread sends the next (GMAC releases the GIL).
        Encrypted pieces go through a scratch piece (the payload is the caller's), tagged in
        line: the helper would read a scratch piece this thread is already refilling."""
        self._bulk.sendall(head)
        tag, view = PayloadTag(key), memoryview(payload)
        if cipher is not None:
            scratch = memoryview(bytearray(CRC_PIECE_BYTES))
            for start in range(0, len(view), CRC_PIECE_BYTES):
                piece = view[start : start + CRC_PIECE_BYTES]
                sealed = scratch[: len(piece)]
                cipher.update_into(piece, sealed)
                self._bulk.sendall(sealed)
                tag.update(sealed)
        else:
            helper = InOrder(tag.update)
            try:
                for start in range(0, len(view), CRC_PIECE_BYTES):
                    piece = view[start : start + CRC_PIECE_BYTES]
                    self._bulk.sendall(piece)
                    helper.put(piece)
            finally:
                helper.close()
        self._bulk.sendall(tag.finalize())

    def _recv_bulk(self, view: memoryview, key: bytes,
                   cipher: PayloadCipher | None) -> tuple[int, bytes, bytes]:
        """Receive into `view` and the tag after it on a worker thread; returns (its CRC-32,
        its GMAC tag, the tag received). A helper thread tags each piece (and decrypts it in
        place, and takes its CRC-32) as soon as it landed, still in cache, while this thread
        receives the next into the rest of `view`."""
        tag, crc = PayloadTag(key), [0]

        def check(piece: memoryview) -> None:
            tag.update(piece)  # the tag is over what travelled
            if cipher is not None:
                cipher.update_into(piece, piece)
            crc[0] = crc32(piece, crc[0])

        helper = InOrder(check)
        got = checked = 0
        try:
            while got < len(view):
                got = self._recv_bulk_into(view, got)
                if got - checked >= CRC_PIECE_BYTES or got == len(view):
                    helper.put(view[checked:got])
                    checked = got
        finally:
            helper.close()
        received, got = memoryview(bytearray(TAG_BYTES)), 0
        while got < TAG_BYTES:
            got = self._recv_bulk_into(received, got)
        return crc[0], tag.finalize(), received.tobytes()

    def _recv_bulk_into(self, view: memoryview, got: int) -> int:
        """One receive on the bulk socket into `view[got:]`; the new count of bytes in it."""
        n = self._bulk.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection mid-frame")
        return got + n

    async def recv(self) -> Frame:
        """Read and authenticate the next header; the caller then reads `frame.length` bytes."""
        if self._read_timeout is None:
            return self._open(await self.recv_bytes(HEADER_BYTES))
        raw = bytearray(HEADER_BYTES)
        await self._recv_exact(memoryview(raw)[:1])  # idle between frames: not limited
        await self._recv_within(memoryview(raw)[1:])
        return self._open(bytes(raw))

    def _open(self, raw: bytes) -> Frame:
        """Parse and authenticate one header (MAC, sequence number, size limit)."""
        frame, seq = unpack_header(raw)
        expected = self._keys.header_mac(self._recv_dir, raw[: FIELDS.size])
        if not hmac.compare_digest(expected, raw[FIELDS.size :]):
            raise AuthError(f"bad frame authentication on {frame.type.name}")
        if seq != self._recv_seq:
            raise AuthError(f"frame sequence {seq}, expected {self._recv_seq} (replayed?)")
        self._recv_seq += 1
        if frame.length > self._max_payload:
            raise ProtocolError(
                f"oversized frame: {frame.length} payload bytes > limit {self._max_payload}"
            )
        return frame

    async def recv_crc_into(self, frame: Frame, view: memoryview) -> int:
        """Receive the payload of `frame` into `view`; returns its CRC-32 (replicated chunks:
        the receiver checks the chunk CRCs against the whole version's at PUT_END).
        PayloadTampered if its tag is wrong (then the stream is still in step)."""
        if len(view) != frame.length:
            raise ProtocolError(f"payload view of {len(view)} bytes for {frame.length}")
        if not frame.length:
            return crc32(view)
        key = self._keys.payload_key(self._recv_dir, self._recv_seq - 1)  # the header just read
        cipher = self._keys.cipher(self._recv_dir, self._recv_seq - 1)
        if len(view) < BULK_BYTES:
            await self._recv_within(view)
            tag = PayloadTag.of(key, view)
            if cipher is not None:
                cipher.update_into(view, view)
            crc = crc32(view)
            received = await self.recv_bytes(TAG_BYTES)
        else:
            crc, tag, received = await self._loop.run_in_executor(
                self._pools.receive, self._recv_bulk, view, key, cipher)
        if not hmac.compare_digest(tag, received):
            raise PayloadTampered(frame)
        return crc

    async def recv_into(self, frame: Frame, view: memoryview) -> int:
        """Receive the payload of `frame` into `view` and verify it against the CRC-32 in its
        header (fetch replies); returns that CRC-32."""
        crc = await self.recv_crc_into(frame, view)
        if crc != frame.checksum:
            raise ChecksumMismatch(frame)
        return crc

    async def recv_payload(self, frame: Frame) -> bytes:
        data = bytearray(frame.length)
        if await self.recv_crc_into(frame, memoryview(data)) != frame.checksum:
            raise ChecksumMismatch(frame)
        return bytes(data)

    async def discard(self, length: int) -> None:
        """Drain a payload of `length` bytes (and its tag) we decided not to keep, to stay
        in sync."""
        length = wire_payload_bytes(length)
        scratch = memoryview(bytearray(min(length, 1 << 20) or 1))
        while length > 0:
            step = min(length, len(scratch))
            await self._recv_within(scratch[:step])
            length -= step

    async def send_error(self, message: str, flags: int = 0) -> None:
        data = message.encode()[:4096]
        error = Frame(FrameType.ERROR, length=len(data), checksum=crc32(data), flags=flags)
        await self.send(error, data)

    # -- handshake -------------------------------------------------------------------------
    async def server_handshake(self, job: str) -> None:
        server_nonce = os.urandom(NONCE_BYTES)
        await self._loop.sock_sendall(self.sock, CHALLENGE_MAGIC + server_nonce)
        self._keys.nonces = server_nonce
        raw = await self.recv_bytes(HEADER_BYTES)
        frame, seq = unpack_header(raw)
        if frame.type != FrameType.HELLO or seq != 0:
            raise ProtocolError(f"expected HELLO, got {frame.type.name}")
        fixed = NONCE_BYTES + (PUBLIC_KEY_BYTES if frame.flags & FLAG_ENCRYPT else 0)
        if not fixed < frame.length <= fixed + MAX_JOB_NAME_BYTES:
            raise ProtocolError(f"HELLO payload of {frame.length} bytes")
        payload = await self.recv_bytes(frame.length)
        tag = await self.recv_bytes(TAG_BYTES)
        peer_job = payload[fixed:].decode(errors="replace")
        if peer_job != job:
            raise AuthError(f"peer of job {peer_job!r} refused (this sidecar serves {job!r})")
        expected = self._keys.header_mac(self._recv_dir, raw[: FIELDS.size])
        if (not hmac.compare_digest(expected, raw[FIELDS.size :])
                or not hmac.compare_digest(
                    PayloadTag.of(self._keys.payload_key(self._recv_dir, 0), payload), tag)
                or crc32(payload) != frame.checksum):
            raise AuthError(f"peer claiming job {job!r} failed authentication (wrong token)")
        self._recv_seq = 1
        self._keys.nonces = server_nonce + payload[:NONCE_BYTES]
        if fixed == NONCE_BYTES:
            if self._encrypt:
                await self.send_error(PLAINTEXT_REFUSED)
                raise AuthError("refused a peer that does not encrypt (GEMINI_PEER_ENCRYPTION"
                                " is on here)")
            await self.send(Frame(FrameType.WELCOME))
            return
        own, public = new_key_pair()
        await self.send(Frame(FrameType.WELCOME, length=len(public), checksum=crc32(public),
                              flags=FLAG_ENCRYPT), public)
        self._keys.agree(own, payload[NONCE_BYTES:fixed])

    async def client_handshake(self, job: str) -> None:
        challenge = await self.recv_bytes(CHALLENGE_BYTES)
        if challenge[: len(CHALLENGE_MAGIC)] != CHALLENGE_MAGIC:
            raise ProtocolError(f"peer is not a GEMINI sidecar of this protocol version "
                                f"(challenge {challenge[: len(CHALLENGE_MAGIC)]!r}, "
                                f"expected {CHALLENGE_MAGIC!r})")
        server_nonce = challenge[len(CHALLENGE_MAGIC) :]
        client_nonce = os.urandom(NONCE_BYTES)
        own, public = new_key_pair() if self._encrypt else (None, b"")
        payload = client_nonce + public + job.encode()
        self._keys.nonces = server_nonce
        hello = Frame(FrameType.HELLO, length=len(payload), checksum=crc32(payload),
                      flags=FLAG_ENCRYPT if own is not None else 0)
        await self.send(hello, payload)
        self._keys.nonces = server_nonce + client_nonce
        reply = await self.recv()
        if reply.type == FrameType.ERROR:
            raise PeerRefused((await self.recv_payload(reply)).decode(errors="replace"))
        if reply.type != FrameType.WELCOME:
            raise ProtocolError(f"expected WELCOME, got {reply.type.name}")
        if own is None:
            return
        if not reply.flags & FLAG_ENCRYPT or reply.length != PUBLIC_KEY_BYTES:
            raise ProtocolError("the peer did not agree to encrypt (an older sidecar?)")
        self._keys.agree(own, await self.recv_payload(reply))

    def close(self) -> None:
        # Wakes a worker thread blocked in a bulk send or receive (OSError: not connected).
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self._bulk.close()
        self.sock.close()
