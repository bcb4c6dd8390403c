"""The parts of bench/bench_remote_read.py: its readers, its shaping proxy, its report."""
