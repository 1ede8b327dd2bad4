"""Drivers of real lattice-pool processes, shared by tests/ and bench/.

- harness.procs: child environment, process tags, waiting on conditions;
- harness.worker: a worker process driven over its own pipes (WorkerProc);
- harness.pool: `lattice-pool serve` driven over stdin/stdout (PoolProc,
  and RawPool for clients that read, or do not read, the raw stream);
- harness.fakes: model dirs and configs for the fake worker (tests.fakeworker);
- harness.cli: the `lattice-pool` command as a user runs it, its `ps` table;
- harness.http: clients of the HTTP surface, polite and hostile;
- harness.metrics: the Prometheus page, found in the log and scraped;
- harness.engine: the worker's scheduler driven in this process;
- harness.prompts: prompts for the demo models;
- harness.frames: a frame writer and reader to check ipc.framing against.
"""
