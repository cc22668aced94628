"""Choosing the sharding strategy: ``shardlight plan`` (estimate + recommendation), ``shardlight profile``
(measured sweep). ``estimate`` counts bytes and seconds, ``recommend`` decides, ``profile`` measures."""
