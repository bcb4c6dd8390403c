"""Sample keys of PiD-written tars, derived the way PiD's own reader derives them.

PiD's ``scripts/sharding_wds.py`` names a member ``<dataset>__<basename><ext>`` and keeps the
basename's dots (``photos__rotated.exif6.jpg``). Its reader
(``imaginaire/datasets/webdataset/utils/iterators.py``, ``process_sample``) splits the member
name at every dot, joins all parts but the last with ``-`` and renames the member
``<prefix>.<modality>.<last part>``; webdataset's ``group_by_keys`` then takes the part before
the first dot as the key. So PiD trains on key ``photos__rotated-exif6`` with field
``image.jpg`` - where the WebDataset rule (first dot) would give key ``photos__rotated`` and
field ``image.exif6.jpg``. Reading PiD-written data (a manifest without ``format_version``), the
loader uses this rule, so both readers see the same samples under the same keys.

Our own builds make keys dot-free at intake, so for them both rules agree.
"""

from __future__ import annotations


def split_pid_member_name(name: str) -> tuple[str, str]:
    """``(key, extension)`` of a member name, as PiD's reader derives them.

    ``photos__rotated.exif6.jpg`` -> ``("photos__rotated-exif6", "jpg")``;
    ``a.jpg`` -> ``("a", "jpg")``. A name without a dot, which PiD's reader drops (its renamed
    member starts with a dot and matches no key), keeps the whole name as its key and no
    extension, as under the WebDataset rule: the loader never drops a member silently.
    """
    parts = name.split(".")
    if len(parts) == 1:
        return name, ""
    return "-".join(parts[:-1]), parts[-1]
