"""The slot file one rank's trainer writes and its sidecar reads, in shared memory.

``gemini.slots.layout``: the file's format (headers, where each slot lies, the checksum, where
the file lives) and its mapping. ``gemini.slots.words``: the words the sidecar and the
training processes of a node tell each other through it. ``gemini.slots.shard``: the two-slot
protocol (``ShardSlots``: one writer, readers that take no lock, the overwrite rule). What a
slot's payload holds is the trainer's (gemini_trainer.payload). No torch here (numpy, mmap,
struct, zlib, ISA-L only) so the sidecar can map the same file.
"""
