"""The engine core: scheduler, KV blocks, runner and sampler (one engine thread, in the engine
process or embedded in the front end's)."""
