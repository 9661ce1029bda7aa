# The checkpointer: the names, manifest + layout, the request checks, io_uring writer, SigV4 signing, S3
# client, load/reshard (the components); the handle's files bottom-up (what they share, the S3
# mirror, the snapshot's copies and fences, staging and data file, commit + retention, then
# the public calls: save, restore, the handle); train_state.c: a run's whole training state (layers, optimizers, user tensors) as
# one set of entries.
list(APPEND MOE_SOURCES src/ckpt/names.c src/ckpt/manifest.c src/ckpt/request.c src/ckpt/writer.c src/ckpt/sigv4.c src/ckpt/s3.c
     src/ckpt/load.c src/ckpt/handle.c src/ckpt/mirror.c src/ckpt/copy.c src/ckpt/shard.c src/ckpt/commit.c
     src/ckpt/snapshot.c src/ckpt/restore.c src/ckpt/ckpt.c src/ckpt/train_state.c)
list(APPEND MOE_PRIVATE_LIBS PkgConfig::MOE_URING PkgConfig::MOE_CJSON PkgConfig::MOE_XXHASH
     PkgConfig::MOE_CRYPTO CURL::libcurl)
