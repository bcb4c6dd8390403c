"""``build_dataset``: from a dataset name (or manifests) to a resumable training loader."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from loader.mixture.definition import Mixture
from loader.wds.dataset import TwinTarDataset
from loader.wds.decode import CAPTION_FIELDS, Decoder
from loader.wds.discovery import catalog_mixture, load_wdinfo
from loader.wds.distributed import data_parallel_rank, run_on_rank0_and_broadcast
from loader.wds.expand import ExpandOptions
from loader.wds.image import ImageTransform, check_image_transform
from loader.wds.resume import ResumableLoader
from loader.wds.shard_table import Wdinfo
from loader.wds.shardlists import ShardlistBasic, ShardlistBasicParallelSync
from loader.wds.twin_reader import read_indexes_soon


def build_dataset(
    spec: str | Sequence[str] | Wdinfo | Mixture,
    *,
    catalog: str | None = None,
    modalities: Sequence[str] | None = None,
    aspect_ratios: Iterable[str] | None = None,
    mode: str = "zip",
    missing_key_policy: str = "skip",
    zip_fallback_to_index: bool = False,
    shard_error_policy: str = "raise",
    seed: int = 0,
    shuffle: bool = True,
    shuffle_buffer: int = 0,
    infinite: bool = False,
    decode: str | None = "pil",
    caption_fields: Sequence[str] = CAPTION_FIELDS,
    caption_weights: Sequence[float] | None = None,
    trusted_data: bool = False,
    on_decode_error: str = "raise",
    augment: Sequence[Callable[[dict], dict | None]] = (),
    image_transform: ImageTransform | Sequence[ImageTransform] | None = None,
    batch_size: int | None = None,
    same_aspect_batches: bool = False,
    drop_last: bool = False,
    group_id: int | None = None,
    num_groups: int | None = None,
    dp_group: Any = None,
    parallel_sync: bool = False,
    stream_config: Any = None,
    verify: str | None = None,
) -> TwinTarDataset:
    """A TwinTarDataset for this data-parallel rank.

    ``spec`` is a dataset name (resolved through ``catalog``), manifest paths/folders/globs, or
    an already parsed :class:`Wdinfo`. With tensor/context parallelism pass ``parallel_sync=True``
    plus ``group_id``/``num_groups`` or ``dp_group``: ranks of one group then read identical
    streams. Decoding is safe by default (``trusted_data=False``: no pickle, no torch.load).
    ``on_decode_error="skip"`` leaves out a sample that cannot be decoded and counts it (with its
    key) in the loader's ``stats`` (``decode_errors``, ``decode_error_keys``); ``"raise"`` (the
    default) stops with the ``DecodeError``. ``verify="sha256"`` reads every tar whole and checks
    it against the checksum its manifest lists (``ChecksumError``, a shard error: counted and
    skipped under ``shard_error_policy="skip"``); manifests without checksums are refused then.

    The epoch's order depends on ``seed``, the epoch, the shards and ``shuffle_buffer`` (a
    shuffle window over the order), and with ``same_aspect_batches`` on ``batch_size``; never
    on the world size or ``num_workers`` (``loader/wds/epoch_plan.py``). With ``batch_size`` every
    rank gets the same number of batches, each full but the last of the epoch (with
    ``same_aspect_batches``: but each bucket's last); ``drop_last=True`` leaves those out.

    A :class:`loader.mixture.Mixture`, or the name of a weighted dataset in the catalog, gives
    a mixture (``loader/mixture``): its own order, dealt and resumed the same way; its samples
    also carry ``__source__`` and ``__repeat__``.

    ``image_transform`` (``loader.wds.image``: ``Resize``, ``CenterCrop``, ``RandomCrop``,
    ``RandomResizedCrop``, or a list of them) is the crop and resize training applies, declared
    so that images are decoded at that size (a JPEG at a DCT scale and only the crop's region:
    ``image_decode.py``); its random numbers depend on (seed, epoch, sample key) only.

    ``batch_size``/``drop_last`` here are a deprecated alias of ``make_loader(dataset,
    batch_size=, drop_last=)``: the one convention of both loaders (LeRobot's takes it there too).
    """
    if image_transform is not None:  # before any manifest is read: one clear error
        image_transform = check_image_transform(image_transform, decode)
    if batch_size is not None:
        warnings.warn("build_dataset(batch_size=) is deprecated: pass batch_size (and drop_last) to "
                      "make_loader(dataset, batch_size=...), as the LeRobot loader takes them",
                      DeprecationWarning, stacklevel=2)
    mix = spec if isinstance(spec, Mixture) else None
    if mix is None and isinstance(spec, str):
        mix = run_on_rank0_and_broadcast(lambda: catalog_mixture(spec, catalog))
    sync = parallel_sync or group_id is not None or dp_group is not None
    if mix is not None:
        from loader.mixture.shardlist import MixtureShardlist
        from loader.mixture.sources import load_mixture

        if same_aspect_batches:
            raise ValueError(f"dataset {mix.name!r}: same_aspect_batches is not supported for mixtures yet; "
                             "filter one aspect ratio per mixture (aspect_ratios=[...]) instead")
        sources = load_mixture(mix, catalog=catalog, modalities=modalities, aspect_ratios=aspect_ratios,
                               keep_sha256=verify == "sha256")
        rank = data_parallel_rank(group_id, num_groups, dp_group) if sync else data_parallel_rank()
        shardlist: ShardlistBasic = MixtureShardlist(sources, seed=seed, shuffle=shuffle, infinite=infinite,
                                                     rank=rank)
        table, modalities = sources.table, sources.modalities
    else:
        info = spec if isinstance(spec, Wdinfo) else load_wdinfo(
            spec, catalog=catalog, modalities=modalities, aspect_ratios=aspect_ratios,
            keep_sha256=verify == "sha256",
        )
        table = info.tar_files
        common = {"seed": seed, "shuffle": shuffle, "infinite": infinite, "chunk_size": info.chunk_size,
                  "bucket_ids": table.bucket_ids}
        if sync:
            shardlist = ShardlistBasicParallelSync(
                table.counts, group_id=group_id, num_groups=num_groups, dp_group=dp_group, **common
            )
        else:
            shardlist = ShardlistBasic(table.counts, rank=data_parallel_rank(), **common)
    if verify is not None and table.sha256 is None:
        raise ValueError("verify='sha256' needs the manifests' checksums: pass a spec, or parse with keep_sha256=True")
    options = ExpandOptions(
        mode=mode, missing_key_policy=missing_key_policy, zip_fallback_to_index=zip_fallback_to_index,
        shard_error_policy=shard_error_policy, stream_config=stream_config, verify=verify,
    )
    decoder = None
    if decode is not None:
        decoder = Decoder(image=decode, caption_fields=caption_fields, caption_weights=caption_weights,
                          trusted_data=trusted_data, seed=seed, image_transform=image_transform)
    dataset = TwinTarDataset(
        table, shardlist, modalities=modalities, options=options, shuffle_buffer=shuffle_buffer,
        decoder=decoder, maps=augment, batch_size=batch_size, same_aspect_batches=same_aspect_batches,
        on_decode_error=on_decode_error, drop_last=drop_last,
    )
    # A remote dataset's key indexes (a large one's: of the plan's first shards), while the loader is made.
    read_indexes_soon(table, dataset.modalities, options, dataset.first_tasks())
    return dataset


_KEEP = object()   # make_loader without batch_size: the dataset's (deprecated build_dataset(batch_size=))


def make_loader(dataset: TwinTarDataset, *, batch_size: Any = _KEEP, num_workers: int = 0,
                **dataloader_kwargs: Any) -> ResumableLoader:
    """A resumable DataLoader over ``dataset``: ``batch_size`` samples per batch (None: samples)
    and ``drop_last``, as ``loader.lerobot.streaming.make_loader(ds, batch_size=)`` takes them
    (the one convention for both loaders; ``build_dataset(batch_size=)`` is a deprecated alias)."""
    decoder = getattr(dataset, "decoder", None)
    if num_workers and getattr(decoder, "image", None) == "cuda":
        raise ValueError("decode='cuda' decodes in the training process (CUDA tensors cannot leave DataLoader "
                         f"workers safely): use num_workers=0, or decode='tensor' with workers; got num_workers={num_workers}")
    drop_last = dataloader_kwargs.pop("drop_last", None)
    if batch_size is not _KEEP or drop_last is not None:
        if batch_size is _KEEP:
            batch_size = dataset.batch_size
        elif dataset.batch_size is not None and batch_size != dataset.batch_size:
            raise ValueError(f"make_loader(batch_size={batch_size!r}) but the dataset was built with "
                             f"batch_size={dataset.batch_size!r}: give it to make_loader only")
        dataset.set_batching(batch_size, drop_last=dataset.drop_last if drop_last is None else bool(drop_last))
    return ResumableLoader(dataset, num_workers=num_workers, **dataloader_kwargs)
