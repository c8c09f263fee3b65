"""One served model as a composition of single-role parts (``runtime.ModelRuntime`` composes them).

Import order, lowest first (each module imports only those before it): ``env`` (what a model
needs from its node and its workers), ``core`` (identity and the state every part reads),
``queues`` (rings and tensor queues), ``dispatch`` (submit, schedule, answer: the
coordinator's piece), ``instances`` (worker handles: the workers' ``WorkerOwner``),
``residency`` (load, unload, evict: the memory manager's piece), ``placement`` (resize,
repack, partitions: the applier's and the partition manager's piece) and ``runtime`` (the
facade that transports and management see). A lower part that must tell a higher one
something is handed a callable for it by the facade, never the part.
"""
