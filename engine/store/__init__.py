"""The packed expert store: one file of 4 KiB-aligned records plus a JSON manifest (and the converted model's).

odirect  — the O_DIRECT probe, aligned buffers, full preadv/pwritev
manifest — what a store holds and how to load it (checked before it is believed; one-line reasons)
manifest_file — a manifest's bytes: written with its sha256 sidecar, read back bounded and checked
model_manifest — every file of a converted model directory with its size and sha256
pack     — checkpoint → staging store → verified → published by rename
verify   — the sha256 re-read with parallel O_DIRECT readers
"""
