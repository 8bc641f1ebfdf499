"""The packed expert store: one file of 4 KiB-aligned records plus a JSON manifest.

odirect  — the O_DIRECT probe, aligned buffers, full preadv/pwritev
manifest — what a store holds and how to load it (one-line reasons when it cannot)
pack     — checkpoint → staging store → verified → published by rename
verify   — the sha256 re-read with parallel O_DIRECT readers
"""
