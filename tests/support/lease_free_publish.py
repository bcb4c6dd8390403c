"""A publisher of an ``s3://`` output that ignores the build lease and stages nothing: an older
release or a script, which only the conditional pointer switch can stop. It sends a version built
in a local folder (``pid-shard --output-dir <folder>``) as ``versions/<id>/`` and switches the
pointer from the one it read first, holding the publish claim and the pause points a build
holds (``publish:before-switch``). ``main``: ``FOLDER URL`` from the command line;
prints the version's URL."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from loader.formats.layout import STATE_DIR
from loader.formats.version_pointer import version_dir
from loader.formats.wdinfo import WDINFO_NAME
from pid_platform.sharding.commit.claims import this_process
from pid_platform.sharding.commit.s3_output import (
    CARRIED_STATE,
    S3Output,
    publish_claims,
    read_pointer_tagged,
    switch_pointer,
    version_id,
)
from pid_platform.sharding.layout import final_dir
from pid_platform.sharding.pause_points import pause_point


def publish(folder: Path, output: S3Output) -> str:
    final = final_dir(folder)
    files = sorted(p.relative_to(final).as_posix() for p in final.rglob("*")
                   if p.is_file() and p.relative_to(final).parts[0] != STATE_DIR)
    files += [f"{STATE_DIR}/{n}" for n in CARRIED_STATE if (final / STATE_DIR / n).is_file()]
    vid = version_id(final)
    current, etag = read_pointer_tagged(output)
    holder = this_process()
    with publish_claims(output, {vid}, holder=holder) as (claim,):
        for rel in files:
            output.store().put(output.key(version_dir(vid), rel), final / rel)
        pause_point("publish:before-switch")
        claim.check()
        switch_pointer(output, vid, [r for r in files if r.endswith(WDINFO_NAME)], current, etag, holder, time.time)
    return f"{output}/{version_dir(vid)}"


def main() -> None:
    print(publish(Path(sys.argv[1]), S3Output(sys.argv[2])))
