/*
 * The trainer's configuration: every knob of a run (model, mesh, optimizer, schedule, data,
 * checkpoints, logging) in one struct, read from an embedded default, then a JSON file
 * (--config), then command-line flags, and validated before any rank starts work.
 *
 * Keys are "<section>.<name>" (model.hidden, mesh.ep, optim.lr, ...); the JSON file nests them
 * ({"model": {"hidden": 64}}) and every key is also a flag (--model.hidden 64). docs/trainer.md
 * lists them; --print-config prints the effective configuration as JSON.
 */
#ifndef TRAINER_CONFIG_H
#define TRAINER_CONFIG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define TRAINER_MAX_PATHS 64

typedef struct trainer_config {
    /* model */
    int64_t layers, hidden, heads, context, ffn_hidden;
    int64_t experts, top_k;
    double capacity_factor, aux_loss_coef, z_loss_coef, init_std;
    int64_t aux_global_batch;
    char score_fn[16];
    int64_t expert_bias;
    double expert_bias_rate;
    /* mesh */
    int64_t tp, ep, dp, pp;
    /* train */
    int64_t steps, batch, microbatches, virtual_stages;
    int64_t seed;
    char backend[16];
    /* optim */
    double lr, beta1, beta2, eps, weight_decay, grad_clip, min_lr_ratio;
    int64_t warmup_steps;
    char decay[16];
    /* data */
    char *paths[TRAINER_MAX_PATHS];
    int npaths;
    double val_fraction;
    int64_t eval_every, eval_batches;
    /* ckpt */
    char ckpt_dir[512];
    int64_t ckpt_every, keep_last;
    int64_t resume;
    char s3_endpoint[256], s3_bucket[128], s3_prefix[256];
    /* log */
    char metrics[512];
    int64_t progress_every;
    double peak_tflops;
    /* test: the rank on elastic slot slow_slot sleeps slow_ms in every training step, a slow
     * device for the straggler tests (docs/elastic.md) */
    int64_t slow_slot;
    double slow_ms;
    /* what to do */
    int print_config, help, plan;
    int64_t print_meshes; /* with print_config: every valid mesh of up to this many ranks */
} trainer_config_t;

/* Set c to the embedded default (no file needed). */
void trainer_config_default(trainer_config_t *c);
/* Free the strings the config owns (data paths). */
void trainer_config_free(trainer_config_t *c);

/* Apply argv (flags, --config FILE read first). err gets a message naming the argument or
 * key on failure. Returns 0 on success. */
int trainer_config_parse_args(trainer_config_t *c, int argc, char **argv, char *err, size_t len);
/* Check values and their consistency with a world of `world` ranks (0: skip the world check).
 * Returns 0 when valid, else fills err naming the key. */
int trainer_config_validate(const trainer_config_t *c, int world, char *err, size_t len);
/* The effective configuration as JSON text (malloc'd). */
char *trainer_config_to_json(const trainer_config_t *c);
/* The effective initial standard deviation and peak learning rate: the keys' values, or for 0
 * (the default) the width-scaled ones docs/trainer.md derives (init_std sqrt(2 / (5 H)),
 * lr 3e-3 * min(1, sqrt(256 / H))). */
double trainer_init_std(const trainer_config_t *c);
double trainer_lr(const trainer_config_t *c);
/* The usage text. */
void trainer_config_usage(FILE *out);

#endif /* TRAINER_CONFIG_H */
