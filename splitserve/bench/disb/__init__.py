"""``splitserve bench disb``: REEF's DISB workloads under five RT/BE preemption schemes.

- ``workload``: DISB's JSON workload files, the published workloads A-E and REAL, and their
  arrival schedules;
- ``run``: one run's load-generator job and the pure analysis of its samples and events;
- ``report``: the report's tables, headline lines and figures;
- ``scenario``: the scenario itself (parameters, servers, calibration, the runs).
"""
