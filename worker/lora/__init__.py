"""LoRA adapters in the worker: `formats` reads and checks the files users
bring, `layers` applies several adapters to the model at once, unfused, each
row with its own, `residency` holds what is known about each adapter path
and whom to evict, `manager` loads adapters off the token path, keeps up to
max_adapters resident and gives each request its version."""
