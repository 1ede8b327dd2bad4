"""LoRA adapters in the worker: `formats` reads and checks the files users
bring, `layers` applies several adapters to the model at once, unfused, each
row with its own, `residency` holds what is resident (each adapter path, the
version in each slot, the rows pinning them) and whom to evict, `reads` is
the reader thread that loads adapters off the token path, and `manager`
keeps the adapter messages and requests' loads in order and gives each
request its version."""
