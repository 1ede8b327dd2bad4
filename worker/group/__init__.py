"""One model over several processes (ranks): the plan, the launcher, each rank's model share and server."""
