"""What the processes sharing a slot file tell each other through its words page.

The sidecar tells the trainer which own version every holder has (acknowledged) and which one
an upload still reads (pinned); the training processes of one node tell each other which
snapshot they have begun and which regions of it are written (gemini_trainer.node_shard).
Offsets: gemini.slots.layout. Each word is stored and loaded whole, so no lock is needed.
"""

from __future__ import annotations

import numpy as np

from gemini.slots.layout import ACKNOWLEDGED_WORD, BEGIN_KEY_WORD, PINNED_WORD, REGION_WORDS


class SharedWords:
    """The words of a mapped slot file (``_words``: its int64 view, set by SlotFile)."""

    _words: np.ndarray

    @property
    def acknowledged_seq(self) -> int:
        return int(self._words[ACKNOWLEDGED_WORD])

    @property
    def pinned_seq(self) -> int:
        return int(self._words[PINNED_WORD])

    def acknowledge(self, seq: int) -> None:
        """Every holder has the own version committed with sequence number ``seq`` (and so
        every older one is no longer needed). Only ever moves forward."""
        if seq > self.acknowledged_seq:
            self._words[ACKNOWLEDGED_WORD] = seq

    def pin(self, seq: int) -> None:
        """Keep the version with sequence number ``seq`` (0: keep nothing extra)."""
        self._words[PINNED_WORD] = seq

    @property
    def begin_key(self) -> int:
        return int(self._words[BEGIN_KEY_WORD])

    def publish_begin(self, key: int) -> None:
        self._words[BEGIN_KEY_WORD] = key

    def region_done(self, local_rank: int) -> tuple[int, int]:
        """(key, CRC-32) that local rank ``local_rank`` published last."""
        at = REGION_WORDS + 2 * local_rank
        return int(self._words[at]), int(self._words[at + 1])

    def publish_region(self, local_rank: int, key: int, crc: int) -> None:
        at = REGION_WORDS + 2 * local_rank
        self._words[at + 1] = crc  # the CRC first: the key says the pair is complete
        self._words[at] = key
