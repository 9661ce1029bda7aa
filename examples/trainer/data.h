/*
 * The trainer's data: files read as bytes, concatenated in path order (folders walked in
 * name order, symbolic links skipped so that a file is read once), the last val_fraction of
 * the bytes held out for validation.
 *
 * Batches are a pure function of (seed, step, sequence index): a sequence is the T + 1 bytes
 * at a position drawn from a counter-based generator, so every rank can compute its own share
 * of any batch without communication, a resumed run sees the batches the uninterrupted one
 * would, and any mesh sees the same global batch. Validation reads fixed, evenly spaced
 * windows of the held-out bytes.
 */
#ifndef TRAINER_DATA_H
#define TRAINER_DATA_H

#include <stddef.h>
#include <stdint.h>

typedef struct corpus {
    uint8_t *bytes;
    size_t size, train_size; /* [0, train_size) train, [train_size, size) validation */
    int files;
    double unigram_bits; /* entropy of the training bytes' histogram, bits per byte */
} corpus_t;

/* Read every file under paths[0..n). err names the path on failure. Returns 0 on success. */
int corpus_load(corpus_t *c, char *const *paths, int n, double val_fraction, int verbose, char *err,
                size_t len);
void corpus_free(corpus_t *c);

/* Sequence `index` of the training batch of `step`: tokens[0..T) are the inputs, targets the
 * next bytes. */
void corpus_train_sequence(const corpus_t *c, uint64_t seed, int64_t step, int64_t index, int64_t T,
                           uint8_t *tokens, uint8_t *targets);
/* Validation sequence `index` of `count` (evenly spaced over the held-out bytes). */
void corpus_val_sequence(const corpus_t *c, int64_t index, int64_t count, int64_t T,
                         uint8_t *tokens, uint8_t *targets);

#endif /* TRAINER_DATA_H */
