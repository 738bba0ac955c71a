"""rlmq benchmarks: they print tables and save figures under ``bench/results``; they never assert timings."""
