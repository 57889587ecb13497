"""Loading: pick the newest checkpoint complete in some tier, gather the shards each rank needs,
verify their checksums, and serve any flat range at the current world size (online resharding).

[Note: choosing what to load]
Each location lists the committed tags in its own view of the save directory (with node-local
storage each node sees only its shards and the replicas it keeps) and the ranks exchange these;
rank 0 also lists the durable copy. Candidates are tried newest first, each location saying which of
the candidate's files it holds ([Note: one inventory per location]). A candidate is usable when the
union of the locations' files plus the durable copy holds every file its manifest names. Each
location then obtains the files its ranks need and lacks: from a peer location over the checkpoint
process group, else from the durable copy. Every rank reads its files whole and checks their
checksums; a corrupt copy is set aside (renamed `*.corrupt`) and the plan is redone without it, so a
good replica still wins. A candidate with a file that has no good copy anywhere is skipped with a
warning, and the next older one is tried.
"""
from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from rayzero.checkpoint.comm import CheckpointComm, CorruptTransfersError, Topology, Transfer, run_transfers
from rayzero.checkpoint.durable import DurableStore
from rayzero.checkpoint.manifest import Manifest, NoCheckpointError, read_manifest
from rayzero.checkpoint.reshard import files_for, plan_read
from rayzero.checkpoint.retention import ForeignDirectoryError, claim_tag_dir, new_lineage
from rayzero.checkpoint.shard_file import (
    CorruptShardError,
    LoadedShardFile,
    dtype_from_name,
    dtype_name,
    scatter_file,
)
from rayzero.checkpoint.types import ShardSpec
from rayzero.config.errors import RayZeroValueError

log = logging.getLogger(__name__)
__all__ = ["LoadedCheckpoint", "NoCheckpointError", "load"]  # NoCheckpointError: its home is manifest.py
_MAX_REPAIRS = 4  # re-plans per candidate after corrupt copies were found


@dataclass
class LoadedCheckpoint:
    """A checkpoint chosen and verified for this rank; `read` serves ranges at any world size."""

    manifest: Manifest
    path: str
    files: dict[str, LoadedShardFile]
    source: str
    """Which tier supplied it: `local`, `peer` (some files from other nodes) or `durable`."""
    filled: dict[str, torch.Tensor] = field(default_factory=dict)
    """Tensors already streamed into the destinations the caller passed (see `load`)."""

    def has(self, name: str) -> bool:
        return name in self.manifest.tensors

    def read(self, spec: ShardSpec) -> torch.Tensor:
        """Elements [flat_start, flat_end) of `spec.name`, as `spec.dtype`, assembled from the saved pieces.

        May be a read-only view into the loaded file: copy it into the live state, do not keep it."""
        entry = self.manifest.tensors.get(spec.name)
        if spec.name in self.filled:  # streamed into the caller's destination already
            return self.filled[spec.name]
        if entry is None:
            raise KeyError(f"checkpoint {self.path} holds no tensor {spec.name!r} (it has "
                           f"{len(self.manifest.tensors)} tensors, e.g. {sorted(self.manifest.tensors)[:3]})")
        if tuple(entry.shape) != tuple(spec.global_shape):
            raise RayZeroValueError(f"checkpoint {self.path}: {spec.name!r} has shape {tuple(entry.shape)}, the model now "
                             f"has {tuple(spec.global_shape)}; load into the same model architecture")
        stored = dtype_from_name(entry.dtype)
        steps = plan_read(spec.name, entry, spec.flat_start, spec.flat_end)
        def piece(step):  # checked against the manifest: a mismatched file raises, naming itself
            data = self.files[step.piece.file].tensor(spec.name, stored, step.piece.end - step.piece.start)
            return data[step.source_start:step.source_end]

        if len(steps) == 1 and stored == spec.dtype:  # the common case: a view, no copy (caller copies)
            return piece(steps[0])
        out = torch.empty(spec.flat_end - spec.flat_start, dtype=spec.dtype)
        for step in steps:
            source = piece(step)
            target = out[step.target_start:step.target_start + (step.source_end - step.source_start)]
            target.copy_(source if stored == spec.dtype else source.to(spec.dtype))
        return out

    def release(self) -> None:
        self.files.clear()
        self.filled.clear()


def _local_tags(root: str) -> dict[str, tuple[int, float]]:
    """tag -> (step, created) of every checkpoint committed under `root` (each manifest read once)."""
    found = {}
    if os.path.isdir(root):
        for entry in os.scandir(root):
            manifest = read_manifest(entry.path) if entry.is_dir() else None
            if manifest is not None:
                found[entry.name] = (manifest.step, manifest.created_unix)
    return found


def gather_tags(comm: CheckpointComm, topology: Topology, root: str) -> list[dict[str, tuple[int, float]]]:
    """Each rank's committed tags under `root`: a location's leader lists them, its other ranks send
    nothing ([Note: one inventory per location]). Collective over all ranks."""
    leads = topology.leader(topology.locations[comm.rank]) == comm.rank
    return comm.all_gather_object(_local_tags(root) if leads else {})


def _present_files(tag_dir: str, manifest: Manifest) -> list[str]:
    """The files of `manifest` present in `tag_dir` with the manifest's size. Only what the directory
    holds is looked at: a node keeps a few of a checkpoint's N files."""
    try:
        names = sorted(set(os.listdir(tag_dir)) & manifest.files.keys())
    except OSError:  # removed since its manifest was read
        return []
    present = []
    for name in names:
        path = os.path.join(tag_dir, name)
        if os.path.isfile(path) and os.path.getsize(path) == manifest.files[name].size:
            present.append(name)
    return present


def gather_presence(comm: CheckpointComm, topology: Topology, root: str, tag: str, holding: set[str]
                    ) -> tuple[dict[str, set[str]], Manifest | None]:
    """(location -> files of `tag` present there, this rank's own reading of its manifest): each
    leader of a location in `holding` lists them. Collective over all ranks.

    [Note: one inventory per location]
    A load learns which files every location holds. Each rank used to list its root and all-gather
    that: with shared storage every rank listed every rank's files. Then only each location's leader
    listed, but every committed checkpoint's files at once (ones never tried included), and through
    torch's padded all-gather: every rank received N copies of the leader's N-file listing, O(N^2)
    bytes per rank and load. Now the leaders send their committed tags first, then the files of each
    candidate as it is tried (usually only the newest), through the unpadded gather ([Note: gathering
    uneven objects] in comm.py): every rank receives about twice the listings' total, O(N) bytes per
    rank with one location or N of them. bench/scale_loader.py: 4,096 ranks on shared storage with 3
    checkpoints, 816 MB per rank before, 0.34 MB now (the manifest each rank receives is 88 MB there)."""
    here = topology.locations[comm.rank]
    manifest = None
    if here in holding and topology.leader(here) == comm.rank:
        manifest = read_manifest(os.path.join(root, tag))
    listed = comm.all_gather_object(_present_files(os.path.join(root, tag), manifest)
                                    if manifest is not None else None)
    present = {topology.locations[rank]: set(files) for rank, files in enumerate(listed) if files is not None}
    return present, manifest


def load(comm: CheckpointComm, topology: Topology, root: str, needed: Iterable[ShardSpec],
         tag: str | None = None, durable: DurableStore | None = None,
         destinations: dict[str, torch.Tensor] | None = None, lineage: str | None = None) -> LoadedCheckpoint:
    """Choose, fetch and verify a checkpoint for this rank. Collective over all ranks.

    `destinations` (spec name -> 1-D tensor for exactly that range, e.g. views of the live state)
    lets files be streamed straight into place, checksummed on the way, in bounded memory; files
    are otherwise read whole. On a corrupt candidate the destinations are overwritten by the next.
    `lineage` owns a tag directory the load creates to hold fetched files ([Note: retention owns
    only its own]); None: a fresh one (nobody's retention removes it).
    """
    lineage = lineage or new_lineage()
    needed = list(needed)
    tags_by_rank = gather_tags(comm, topology, root)
    durable_manifests: dict[str, Manifest] = {}
    if durable is not None and comm.rank == 0:
        durable_manifests = dict(durable.committed())
    durable_index = comm.broadcast_object({tag: (m.step, m.created_unix) for tag, m in durable_manifests.items()})

    holding: dict[str, set[str]] = {}  # tag -> the locations where it is committed
    order: dict[str, tuple[int, float]] = {}
    for rank, tags in enumerate(tags_by_rank):
        for name, key in tags.items():
            holding.setdefault(name, set()).add(topology.locations[rank])
            order[name] = key
    for name, key in durable_index.items():
        order.setdefault(name, key)
    candidates = sorted(order, key=lambda name: order[name], reverse=True)
    if tag is not None:
        candidates = [name for name in candidates if name == tag]
    tried = []
    for candidate in candidates:
        loaded = _try_candidate(comm, topology, root, candidate, holding.get(candidate, set()), needed,
                                durable, durable_manifests.get(candidate), destinations, lineage)
        if loaded is not None:
            if tried and comm.rank == 0:
                warnings.warn(f"loaded checkpoint {candidate!r} instead of the newer {tried}: "
                              "those are incomplete or corrupt in every tier (see the log)", stacklevel=3)
            return loaded
        tried.append(candidate)
    wanted = f"tag {tag!r}" if tag is not None else "any checkpoint"
    raise NoCheckpointError(f"no complete, intact checkpoint ({wanted}) under {root}"
                            + (f" or {durable.uri}" if durable is not None else "")
                            + (f"; tried {tried}" if tried else ""))


def _try_candidate(comm: CheckpointComm, topology: Topology, root: str, tag: str,
                   holding: set[str], needed: list[ShardSpec], durable: DurableStore | None,
                   durable_manifest: Manifest | None,
                   destinations: dict[str, torch.Tensor] | None, lineage: str) -> LoadedCheckpoint | None:
    tag_dir = os.path.join(root, tag)
    here = topology.locations[comm.rank]
    present, local_manifest = gather_presence(comm, topology, root, tag, holding)
    # The manifest: from the first location that read it, else from the durable copy (rank 0).
    holders = [location for location in topology.ordered_locations if location in present]
    source_rank = topology.leader(holders[0]) if holders else 0
    manifest = comm.broadcast_object(local_manifest if comm.rank == source_rank and holders
                                     else durable_manifest if comm.rank == 0 else None, src=source_rank)
    if manifest is None:
        return None
    # the durable copy is committed whole or not at all: rank 0 says which, not the file names
    durable_files = set(manifest.files) if comm.broadcast_object(durable_manifest is not None) else set()
    available = set().union(*present.values()) | durable_files if present else durable_files
    missing = set(manifest.files) - available
    if missing:
        if comm.rank == 0:
            log.warning("checkpoint %s is incomplete in every tier (missing %s); skipping it", tag, sorted(missing))
        return None
    my_files = files_for(manifest.tensors, needed)
    needs = comm.all_gather_object(sorted(my_files))
    used_peer = used_durable = False
    for _ in range(_MAX_REPAIRS):
        transfers, downloads = _plan(topology, present, durable_files, manifest, needs)
        if any(name not in durable_files and not any(name in files for files in present.values())
               for name in set().union(*map(set, needs))):
            break  # a needed file has no good copy left
        used_peer |= bool(transfers)
        used_durable |= bool(downloads)
        if not _claimed_for_fetching(comm, topology, tag_dir, lineage, transfers, downloads):
            break
        failures: list[tuple[str, str]] = []
        # Every rank records the planned copies alike (the next plan must be the same everywhere);
        # a copy that failed is taken back below from the failures all ranks exchange.
        for transfer in transfers:
            present.setdefault(topology.locations[transfer.target], set()).add(transfer.name)
        for rank, name in downloads:
            present.setdefault(topology.locations[rank], set()).add(name)
        try:
            in_tag = lambda transfer: os.path.join(tag_dir, transfer.name)
            run_transfers(comm, transfers, in_tag, in_tag)
            for rank, name in downloads:
                if rank == comm.rank:
                    durable.download(tag, name, os.path.join(tag_dir, name))
        except CorruptTransfersError as error:
            # The sender's copy is bad: drop it (and the copy that never arrived here) and plan again
            # from another holder: a third node, the durable copy.
            log.warning("rank %d: %s", comm.rank, error)
            for transfer in error.transfers:
                failures += [(topology.locations[transfer.source], transfer.name), (here, transfer.name)]
        except (CorruptShardError, OSError) as error:
            log.warning("rank %d could not fetch a shard of %s: %s", comm.rank, tag, error)
            failures.append((here, "*fetch*"))
        comm.barrier()  # fetched files are in place for every rank of the location
        files: dict[str, LoadedShardFile] = {}
        scatters, filled = _scatter_plan(manifest, needed, destinations or {})
        for name in sorted(my_files):
            path = os.path.join(tag_dir, name)
            try:
                if name in scatters:
                    scatter_file(path, manifest.files[name].checksum, scatters[name])
                else:
                    files[name] = LoadedShardFile.read(path, manifest.files[name].checksum)
            except (CorruptShardError, OSError) as error:
                log.warning("rank %d: %s", comm.rank, error)
                failures.append((here, name))
        all_failures = [failure for ranks in comm.all_gather_object(failures) for failure in ranks]
        if not all_failures:
            source = "durable" if used_durable else "peer" if used_peer else "local"
            return LoadedCheckpoint(manifest, tag_dir, files, source,
                                    {name: destinations[name] for name in filled})
        files.clear()
        if any(name == "*fetch*" for _, name in all_failures):
            break
        for location, name in all_failures:
            present.get(location, set()).discard(name)
            bad = os.path.join(tag_dir, name)
            if location == here and topology.leader(here) == comm.rank and os.path.exists(bad):
                os.replace(bad, bad + ".corrupt")  # never picked again; kept for inspection
        if comm.rank == 0:
            warnings.warn(f"checkpoint {tag}: corrupt shard copies {sorted(set(all_failures))} detected by checksum; "
                          "looking for another copy", stacklevel=4)
        comm.barrier()
    if comm.rank == 0:
        log.warning("checkpoint %s has a needed shard with no intact copy in any tier; trying an older one", tag)
    return None


def _claimed_for_fetching(comm: CheckpointComm, topology: Topology, tag_dir: str, lineage: str,
                          transfers: list[Transfer], downloads: list[tuple[int, str]]) -> bool:
    """Each location that will receive files has its tag directory, claimed by its leader before any
    byte arrives ([Note: retention owns only its own]); False on every rank if any location could not."""
    here = topology.locations[comm.rank]
    receives = (any(topology.locations[transfer.target] == here for transfer in transfers)
                or any(topology.locations[rank] == here for rank, _ in downloads))
    problem = None
    if receives and topology.leader(here) == comm.rank:
        try:
            claim_tag_dir(tag_dir, lineage, take_over=False)
        except (OSError, ForeignDirectoryError) as error:
            problem = f"rank {comm.rank}: {error}"
    problems = [found for found in comm.all_gather_object(problem) if found]
    if problems and comm.rank == 0:
        log.warning("cannot fetch the missing files of %s: %s", tag_dir, "; ".join(problems))
    return not problems


def _scatter_plan(manifest: Manifest, needed: list[ShardSpec], destinations: dict[str, torch.Tensor]
                  ) -> tuple[dict[str, list[tuple[str, int, int, torch.Tensor]]], set[str]]:
    """Which needed tensors stream straight into their destination (same dtype, contiguous), per file.

    A file any other tensor needs whole (a dtype conversion, no destination) is read whole instead,
    and every tensor it serves goes through `LoadedCheckpoint.read`."""
    scatters: dict[str, list] = {}
    whole: set[str] = set()
    streamed: dict[str, list] = {}
    for spec in needed:
        entry = manifest.tensors.get(spec.name)
        if entry is None:
            continue
        steps = plan_read(spec.name, entry, spec.flat_start, spec.flat_end)
        target = destinations.get(spec.name)
        if (target is None or target.dtype != spec.dtype or dtype_name(spec.dtype) != entry.dtype
                or not target.is_contiguous() or target.numel() != spec.flat_end - spec.flat_start):
            whole.update(step.piece.file for step in steps)
            continue
        streamed[spec.name] = [(step.piece.file, (spec.name, step.source_start, step.source_end,
                                target[step.target_start:step.target_start + step.source_end - step.source_start]))
                               for step in steps]
    # A tensor touching a whole-read file is served from memory entirely, which makes its other
    # files whole-read too: repeat until nothing changes.
    changed = True
    while changed:
        changed = False
        for pieces in streamed.values():
            files = {file for file, _ in pieces}
            if files & whole and not files <= whole:
                whole |= files
                changed = True
    filled = set()
    for name, pieces in streamed.items():
        if any(file in whole for file, _ in pieces):
            continue
        filled.add(name)
        for file, request in pieces:
            scatters.setdefault(file, []).append(request)
    return scatters, filled


def _plan(topology: Topology, present: dict[str, set[str]], durable_files: set[str], manifest: Manifest,
          needs: list[list[str]]) -> tuple[list[Transfer], list[tuple[int, str]]]:
    """Transfers (peer location -> a rank of the location lacking the file) and durable downloads."""
    transfers, downloads = [], []
    for location in topology.ordered_locations:
        ranks = topology.ranks_at(location)
        have = present.get(location, set())
        wanted: dict[str, int] = {}
        for rank in ranks:
            for name in needs[rank]:
                wanted.setdefault(name, rank)  # the lowest rank of the location that needs it fetches it
        for name, target in sorted(wanted.items()):
            if name in have:
                continue
            holders = [other for other in topology.ordered_locations if name in present.get(other, set())]
            entry = manifest.files[name]
            if holders:
                transfers.append(Transfer(topology.leader(holders[0]), target, name, entry.size, entry.checksum))
            elif name in durable_files:
                downloads.append((target, name))
    return transfers, downloads
