"""The process around the engine: the request server and its threads, the event channel, the lifeline to the supervisor."""
