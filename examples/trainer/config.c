/*
 * The trainer's configuration (config.h): one table names every key with its type, its place
 * in trainer_config_t and its help text, and drives the JSON reader, the flags, the usage text
 * and --print-config alike, so they cannot disagree.
 */
#include "config.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

typedef enum knob_type { K_INT, K_FLOAT, K_STR, K_BOOL, K_PATHS } knob_type_t;

typedef struct knob {
    const char *key;   /* "<section>.<name>" */
    const char *alias; /* a short flag, or NULL */
    knob_type_t type;
    size_t offset, size; /* size: of a K_STR buffer */
    const char *help;
} knob_t;

#define OFF(f) offsetof(trainer_config_t, f)
#define STR(f) OFF(f), sizeof(((trainer_config_t *)0)->f)

static const knob_t knobs[] = {
    {"model.layers", NULL, K_INT, OFF(layers), 0, "transformer blocks L"},
    {"model.hidden", NULL, K_INT, OFF(hidden), 0, "hidden size H"},
    {"model.heads", NULL, K_INT, OFF(heads), 0, "attention heads; 0: max(4, H/128)"},
    {"model.context", NULL, K_INT, OFF(context), 0, "context window T (bytes per sequence)"},
    {"model.ffn_hidden", NULL, K_INT, OFF(ffn_hidden), 0, "expert FFN width F"},
    {"model.experts", NULL, K_INT, OFF(experts), 0, "experts E per MoE layer"},
    {"model.top_k", NULL, K_INT, OFF(top_k), 0, "experts per token K"},
    {"model.capacity_factor", NULL, K_FLOAT, OFF(capacity_factor), 0, "0: dropless"},
    {"model.aux_loss_coef", NULL, K_FLOAT, OFF(aux_loss_coef), 0, "load-balancing loss weight"},
    {"model.aux_global_batch", NULL, K_BOOL, OFF(aux_global_batch), 0,
     "its expert frequencies over the step's microbatches"},
    {"model.z_loss_coef", NULL, K_FLOAT, OFF(z_loss_coef), 0, "router z-loss weight"},
    {"model.init_std", NULL, K_FLOAT, OFF(init_std), 0, "initial std; 0: sqrt(2/(5H))"},
    {"model.score_fn", NULL, K_STR, STR(score_fn), "router scores: softmax | sigmoid"},
    {"model.expert_bias", NULL, K_BOOL, OFF(expert_bias), 0, "aux-loss-free balancing bias"},
    {"model.expert_bias_rate", NULL, K_FLOAT, OFF(expert_bias_rate), 0, "its sign-rule step"},
    {"mesh.tp", NULL, K_INT, OFF(tp), 0, "tensor parallel (expert FFN split)"},
    {"mesh.ep", NULL, K_INT, OFF(ep), 0, "expert parallel"},
    {"mesh.dp", NULL, K_INT, OFF(dp), 0, "data parallel"},
    {"mesh.pp", NULL, K_INT, OFF(pp), 0, "pipeline stages"},
    {"train.steps", "--steps", K_INT, OFF(steps), 0, "optimizer steps (total, also on resume)"},
    {"train.batch", "--batch", K_INT, OFF(batch), 0, "sequences per global batch"},
    {"train.microbatches", NULL, K_INT, OFF(microbatches), 0, "microbatches m per batch"},
    {"train.virtual_stages", NULL, K_INT, OFF(virtual_stages), 0, "interleaved 1F1B chunks"},
    {"train.seed", "--seed", K_INT, OFF(seed), 0, "parameters and batches"},
    {"train.backend", "--backend", K_STR, STR(backend), "host (fp32 C) or cuda (bf16 on the GPU)"},
    {"optim.lr", "--lr", K_FLOAT, OFF(lr), 0, "peak learning rate; 0: 3e-3 min(1, sqrt(256/H))"},
    {"optim.beta1", NULL, K_FLOAT, OFF(beta1), 0, "AdamW beta1"},
    {"optim.beta2", NULL, K_FLOAT, OFF(beta2), 0, "AdamW beta2"},
    {"optim.eps", NULL, K_FLOAT, OFF(eps), 0, "AdamW epsilon"},
    {"optim.weight_decay", NULL, K_FLOAT, OFF(weight_decay), 0, "decoupled weight decay"},
    {"optim.grad_clip", NULL, K_FLOAT, OFF(grad_clip), 0, "global gradient norm limit, 0: off"},
    {"optim.warmup_steps", NULL, K_INT, OFF(warmup_steps), 0, "linear warm-up steps"},
    {"optim.decay", NULL, K_STR, STR(decay), "constant | linear | cosine (to the last step)"},
    {"optim.min_lr_ratio", NULL, K_FLOAT, OFF(min_lr_ratio), 0, "decay floor, fraction of lr"},
    {"data.paths", "--data", K_PATHS, OFF(paths), 0, "files, folders (text files) as bytes"},
    {"data.val_fraction", NULL, K_FLOAT, OFF(val_fraction), 0, "held-out tail of the corpus"},
    {"data.eval_every", "--eval-every", K_INT, OFF(eval_every), 0, "steps between evaluations"},
    {"data.eval_batches", NULL, K_INT, OFF(eval_batches), 0, "batches per evaluation"},
    {"ckpt.dir", "--ckpt-dir", K_STR, STR(ckpt_dir), "checkpoint directory, \"\": none"},
    {"ckpt.every", "--ckpt-every", K_INT, OFF(ckpt_every), 0, "steps between saves (0: last only)"},
    {"ckpt.keep_last", NULL, K_INT, OFF(keep_last), 0, "checkpoints kept"},
    {"ckpt.resume", "--resume", K_BOOL, OFF(resume), 0, "continue from the latest checkpoint"},
    {"ckpt.s3_endpoint", NULL, K_STR, STR(s3_endpoint), "S3 mirror endpoint (AWS_* credentials)"},
    {"ckpt.s3_bucket", NULL, K_STR, STR(s3_bucket), "S3 mirror bucket, \"\": no mirror"},
    {"ckpt.s3_prefix", NULL, K_STR, STR(s3_prefix), "S3 key prefix"},
    {"log.metrics", "--metrics", K_STR, STR(metrics), "JSON-lines metrics file, \"\": none"},
    {"log.progress_every", NULL, K_INT, OFF(progress_every), 0, "steps between progress lines"},
    {"log.peak_tflops", NULL, K_FLOAT, OFF(peak_tflops), 0, "MFU peak; 0: per backend"},
    {"test.slow_slot", NULL, K_INT, OFF(slow_slot), 0, "elastic slot made slow; -1: none"},
    {"test.slow_ms", NULL, K_FLOAT, OFF(slow_ms), 0, "its sleep in every training step"},
};
enum { NKNOBS = sizeof knobs / sizeof knobs[0] };

void trainer_config_default(trainer_config_t *c)
{
    *c = (trainer_config_t){
        .layers = 2,
        .hidden = 64,
        .heads = 0,
        .context = 64,
        .ffn_hidden = 128,
        .experts = 4,
        .top_k = 2,
        .capacity_factor = 0,
        .aux_loss_coef = 0.01,
        .z_loss_coef = 0.001,
        .init_std = 0,
        .expert_bias = 1,
        .expert_bias_rate = 1e-3,
        .tp = 1,
        .ep = 1,
        .dp = 1,
        .pp = 1,
        .steps = 300,
        .batch = 16,
        .microbatches = 2,
        .virtual_stages = 1,
        .seed = 1234,
        .lr = 0,
        .beta1 = 0.9,
        .beta2 = 0.99,
        .eps = 1e-8,
        .weight_decay = 0.01,
        .grad_clip = 1.0,
        .min_lr_ratio = 0.1,
        .warmup_steps = 20,
        .val_fraction = 0.05,
        .eval_every = 50,
        .eval_batches = 4,
        .ckpt_every = 0,
        .keep_last = 2,
        .progress_every = 10,
        .slow_slot = -1,
    };
    strcpy(c->backend, "host");
    strcpy(c->score_fn, "softmax");
    strcpy(c->decay, "cosine");
    c->paths[0] = strdup("/usr/share/common-licenses");
    c->npaths = 1;
}

void trainer_config_free(trainer_config_t *c)
{
    for (int i = 0; i < c->npaths; i++) free(c->paths[i]);
    c->npaths = 0;
}

static int fail(char *err, size_t len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, len, fmt, ap);
    va_end(ap);
    return -1;
}

static const knob_t *find(const char *key)
{
    for (int i = 0; i < NKNOBS; i++)
        if (strcmp(knobs[i].key, key) == 0) return &knobs[i];
    return NULL;
}

/* Whole-string numbers only: "3x", "", "foo" are errors. */
static int parse_int(const char *s, int64_t *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end) return -1;
    *out = v;
    return 0;
}

static int parse_float(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v)) return -1;
    *out = v;
    return 0;
}

static int set_paths(trainer_config_t *c, char **list, int n, const char *key, char *err,
                     size_t len)
{
    if (n > TRAINER_MAX_PATHS)
        return fail(err, len, "%s: %d paths; at most %d", key, n, TRAINER_MAX_PATHS);
    trainer_config_free(c);
    for (int i = 0; i < n; i++) c->paths[i] = strdup(list[i]);
    c->npaths = n;
    return 0;
}

/* Set a knob from text (flags); `what` names the argument in messages. */
static int set_text(trainer_config_t *c, const knob_t *k, const char *v, const char *what,
                    char *err, size_t len)
{
    char *base = (char *)c + k->offset;
    switch (k->type) {
    case K_INT:
        if (parse_int(v, (int64_t *)base))
            return fail(err, len, "%s: \"%s\" is not an integer", what, v);
        return 0;
    case K_FLOAT:
        if (parse_float(v, (double *)base))
            return fail(err, len, "%s: \"%s\" is not a finite number", what, v);
        return 0;
    case K_BOOL:
        if (!strcmp(v, "true") || !strcmp(v, "1"))
            *(int64_t *)base = 1;
        else if (!strcmp(v, "false") || !strcmp(v, "0"))
            *(int64_t *)base = 0;
        else
            return fail(err, len, "%s: \"%s\" is not true/false", what, v);
        return 0;
    case K_STR:
        if (strlen(v) >= k->size)
            return fail(err, len, "%s: longer than %zu bytes", what, k->size - 1);
        strcpy(base, v);
        return 0;
    case K_PATHS: {
        char *one = (char *)v;
        return set_paths(c, &one, 1, what, err, len);
    }
    }
    return fail(err, len, "%s: unknown type", what);
}

/* Set a knob from a JSON value of the right type. */
static int set_json(trainer_config_t *c, const knob_t *k, const cJSON *v, char *err, size_t len)
{
    char *base = (char *)c + k->offset;
    switch (k->type) {
    case K_INT:
        if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble))
            return fail(err, len, "%s: expected an integer", k->key);
        *(int64_t *)base = (int64_t)v->valuedouble;
        return 0;
    case K_FLOAT:
        if (!cJSON_IsNumber(v)) return fail(err, len, "%s: expected a number", k->key);
        *(double *)base = v->valuedouble;
        return 0;
    case K_BOOL:
        if (!cJSON_IsBool(v)) return fail(err, len, "%s: expected true or false", k->key);
        *(int64_t *)base = cJSON_IsTrue(v);
        return 0;
    case K_STR:
        if (!cJSON_IsString(v)) return fail(err, len, "%s: expected a string", k->key);
        return set_text(c, k, v->valuestring, k->key, err, len);
    case K_PATHS: {
        char *list[TRAINER_MAX_PATHS + 1];
        int n = 0;
        if (cJSON_IsString(v))
            list[n++] = v->valuestring;
        else if (cJSON_IsArray(v)) {
            const cJSON *e;
            cJSON_ArrayForEach(e, v)
            {
                if (!cJSON_IsString(e)) return fail(err, len, "%s: expected strings", k->key);
                if (n > TRAINER_MAX_PATHS) break;
                list[n++] = e->valuestring;
            }
        } else
            return fail(err, len, "%s: expected a string or a list of strings", k->key);
        return set_paths(c, list, n, k->key, err, len);
    }
    }
    return fail(err, len, "%s: unknown type", k->key);
}

static int load_json(trainer_config_t *c, const char *path, char *err, size_t len)
{
    FILE *f = fopen(path, "rb");
    if (!f) return fail(err, len, "--config %s: %s", path, strerror(errno));
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)n + 1);
    size_t got = text ? fread(text, 1, (size_t)n, f) : 0;
    fclose(f);
    if (!text) return fail(err, len, "--config %s: out of memory", path);
    text[got] = '\0';
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithOpts(text, &end, 1);
    if (!root) {
        /* cJSON stops where the text stops being JSON: name the line and column */
        size_t at = end ? (size_t)(end - text) : 0, line = 1, col = 1;
        for (size_t i = 0; i < at && text[i]; i++, col++)
            if (text[i] == '\n') line++, col = 0;
        int rc = got == 0 ? fail(err, len, "--config %s: empty file", path)
                          : fail(err, len, "--config %s: invalid JSON at line %zu, column %zu%s",
                                 path, line, col, at >= got ? " (the text ends early)" : "");
        free(text);
        return rc;
    }
    free(text);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return fail(err, len, "--config %s: not a JSON object", path);
    }
    int rc = 0;
    const cJSON *sec;
    cJSON_ArrayForEach(sec, root)
    {
        if (!cJSON_IsObject(sec)) {
            rc = fail(err, len,
                      "%s: unknown key \"%s\" (sections: model, mesh, train, optim, "
                      "data, ckpt, log)",
                      path, sec->string);
            break;
        }
        const cJSON *v;
        cJSON_ArrayForEach(v, sec)
        {
            char key[128];
            snprintf(key, sizeof key, "%s.%s", sec->string, v->string);
            const knob_t *k = find(key);
            if (!k) {
                rc = fail(err, len, "%s: unknown key \"%s\"", path, key);
                break;
            }
            if ((rc = set_json(c, k, v, err, len))) break;
        }
        if (rc) break;
    }
    cJSON_Delete(root);
    return rc;
}

/* --mesh tp=2,ep=2,dp=1,pp=1: the whole mesh, axes in any order; an axis left out is 1 (so
 * `--mesh ep=2` is a 2-rank mesh whatever the config file set). An axis named twice is refused. */
static int set_mesh(trainer_config_t *c, const char *v, char *err, size_t len)
{
    char buf[256];
    if (strlen(v) >= sizeof buf) return fail(err, len, "--mesh: too long");
    strcpy(buf, v);
    trainer_config_t m = *c;
    m.tp = m.ep = m.dp = m.pp = 1;
    int named[4] = {0};
    static const char *const axes[4] = {"tp", "ep", "dp", "pp"};
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(tok, '=');
        if (!eq) return fail(err, len, "--mesh: \"%s\" is not axis=size", tok);
        *eq = '\0';
        int a = 0;
        while (a < 4 && strcmp(tok, axes[a]) != 0) a++;
        if (a == 4) return fail(err, len, "--mesh: unknown axis \"%s\" (tp, ep, dp, pp)", tok);
        if (named[a]++) return fail(err, len, "--mesh: axis %s given twice in \"%s\"", tok, v);
        char key[32];
        snprintf(key, sizeof key, "mesh.%s", tok);
        if (set_text(&m, find(key), eq + 1, "--mesh", err, len)) return -1;
    }
    c->tp = m.tp, c->ep = m.ep, c->dp = m.dp, c->pp = m.pp;
    return 0;
}

int trainer_config_parse_args(trainer_config_t *c, int argc, char **argv, char *err, size_t len)
{
    /* the file first, so that flags override its keys wherever they stand */
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--config")) {
            if (i + 1 >= argc) return fail(err, len, "--config: needs a file");
            if (load_json(c, argv[++i], err, len)) return -1;
        }
    int paths_given = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--config")) {
            i++;
            continue;
        }
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            c->help = 1;
            continue;
        }
        if (!strcmp(a, "--print-config")) {
            c->print_config = 1;
            continue;
        }
        if (!strcmp(a, "--plan")) { /* the memory plan (memplan.h), then exit */
            c->plan = 1;
            continue;
        }
        if (!strcmp(a, "--print-meshes")) { /* the elastic launcher's question */
            char *end;
            c->print_meshes = i + 1 < argc ? strtoll(argv[++i], &end, 10) : 0;
            if (c->print_meshes < 1 || c->print_meshes > 4096 || *end)
                return fail(err, len, "--print-meshes: needs a number of ranks in 1..4096");
            continue;
        }
        if (!strcmp(a, "--resume")) { /* a switch; --ckpt.resume takes a value */
            c->resume = 1;
            continue;
        }
        if (strncmp(a, "--", 2) != 0) return fail(err, len, "%s: not a flag (see --help)", a);
        if (!strcmp(a, "--mesh")) {
            if (i + 1 >= argc) return fail(err, len, "--mesh: needs tp=..,ep=..,dp=..,pp=..");
            if (set_mesh(c, argv[++i], err, len)) return -1;
            continue;
        }
        const knob_t *k = NULL;
        for (int j = 0; j < NKNOBS && !k; j++)
            if ((knobs[j].alias && !strcmp(a, knobs[j].alias)) || !strcmp(a + 2, knobs[j].key))
                k = &knobs[j];
        if (!k) return fail(err, len, "%s: unknown flag (see --help)", a);
        if (k->type == K_PATHS) { /* every following non-flag argument */
            if (paths_given++)
                return fail(err, len, "%s: given twice; list every path after one %s", a, a);
            int n = 0;
            while (i + 1 + n < argc && strncmp(argv[i + 1 + n], "--", 2) != 0) n++;
            if (n == 0) return fail(err, len, "%s: needs at least one path", a);
            if (set_paths(c, &argv[i + 1], n, a, err, len)) return -1;
            i += n;
            continue;
        }
        if (i + 1 >= argc) return fail(err, len, "%s: needs a value", a);
        if (set_text(c, k, argv[++i], a, err, len)) return -1;
    }
    /* heads of at most 128 dims (the CUDA attention's limit) at any width, 4 up to H = 512 */
    if (c->heads == 0) c->heads = c->hidden / 128 > 4 ? c->hidden / 128 : 4;
    return 0;
}

#define NEED(cond, ...)                                                                            \
    do {                                                                                           \
        if (!(cond)) return fail(err, len, __VA_ARGS__);                                           \
    } while (0)

int trainer_config_validate(const trainer_config_t *c, int world, char *err, size_t len)
{
    NEED(!strcmp(c->backend, "host") || !strcmp(c->backend, "cuda"),
         "train.backend: \"%s\" is not served by this trainer (host: the C reference in fp32; "
         "cuda: bf16 on the GPU)",
         c->backend);
    NEED(c->layers >= 1, "model.layers: %lld; must be >= 1", (long long)c->layers);
    NEED(c->hidden >= 1 && c->heads >= 1 && c->hidden % c->heads == 0,
         "model.hidden (%lld) must be a positive multiple of model.heads (%lld)",
         (long long)c->hidden, (long long)c->heads);
    NEED(c->context >= 2, "model.context: %lld; must be >= 2", (long long)c->context);
    NEED(c->ffn_hidden >= 1, "model.ffn_hidden: %lld; must be >= 1", (long long)c->ffn_hidden);
    NEED(c->experts >= 1 && c->top_k >= 1 && c->top_k <= c->experts,
         "model.top_k (%lld) must be in 1..model.experts (%lld)", (long long)c->top_k,
         (long long)c->experts);
    NEED(c->capacity_factor >= 0, "model.capacity_factor: must be >= 0");
    NEED(c->init_std >= 0, "model.init_std: must be >= 0 (0: sqrt(2 / (5 H)))");
    NEED(!strcmp(c->score_fn, "softmax") || !strcmp(c->score_fn, "sigmoid"),
         "model.score_fn: \"%s\"; softmax or sigmoid", c->score_fn);
    NEED(c->expert_bias_rate >= 0, "model.expert_bias_rate: must be >= 0");
    NEED(c->tp >= 1 && c->ep >= 1 && c->dp >= 1 && c->pp >= 1, "mesh: every axis must be >= 1");
    NEED(world == 0 || c->tp * c->ep * c->dp * c->pp == world,
         "mesh: tp*ep*dp*pp = %lld*%lld*%lld*%lld = %lld, but mpirun started %d ranks",
         (long long)c->tp, (long long)c->ep, (long long)c->dp, (long long)c->pp,
         (long long)(c->tp * c->ep * c->dp * c->pp), world);
    NEED(c->experts % c->ep == 0, "model.experts (%lld) must be divisible by mesh.ep (%lld)",
         (long long)c->experts, (long long)c->ep);
    NEED(c->ffn_hidden % c->tp == 0,
         "model.ffn_hidden (%lld) must be divisible by mesh.tp "
         "(%lld)",
         (long long)c->ffn_hidden, (long long)c->tp);
    NEED(c->virtual_stages >= 1, "train.virtual_stages: must be >= 1");
    NEED(c->layers % (c->pp * c->virtual_stages) == 0,
         "model.layers (%lld) must be divisible by mesh.pp x train.virtual_stages (%lld)",
         (long long)c->layers, (long long)(c->pp * c->virtual_stages));
    NEED(c->virtual_stages == 1 || (c->pp >= 2 && c->microbatches % c->pp == 0),
         "train.virtual_stages > 1 needs mesh.pp >= 2 and train.microbatches divisible by it");
    NEED(c->steps >= 1, "train.steps: %lld; must be >= 1", (long long)c->steps);
    NEED(c->seed >= 0, "train.seed: must be >= 0");
    NEED(c->microbatches >= 1, "train.microbatches: must be >= 1");
    int64_t shards = c->ep * c->dp * c->microbatches;
    NEED(c->batch >= 1 && c->batch % shards == 0,
         "train.batch (%lld) must be divisible by mesh.ep x mesh.dp x train.microbatches (%lld)",
         (long long)c->batch, (long long)shards);
    NEED(c->lr >= 0, "optim.lr: must be >= 0 (0: 3e-3 min(1, sqrt(256 / H)))");
    NEED(c->beta1 >= 0 && c->beta1 < 1 && c->beta2 >= 0 && c->beta2 < 1,
         "optim.beta1/beta2: must be in [0, 1)");
    NEED(c->eps > 0 && c->weight_decay >= 0 && c->grad_clip >= 0,
         "optim.eps > 0, optim.weight_decay >= 0, optim.grad_clip >= 0");
    NEED(!strcmp(c->decay, "constant") || !strcmp(c->decay, "linear") ||
             !strcmp(c->decay, "cosine"),
         "optim.decay: \"%s\"; constant, linear or cosine", c->decay);
    NEED(c->warmup_steps >= 0 && (c->warmup_steps < c->steps || !strcmp(c->decay, "constant")),
         "optim.warmup_steps (%lld) must be >= 0 and below train.steps when decaying",
         (long long)c->warmup_steps);
    NEED(c->min_lr_ratio >= 0 && c->min_lr_ratio <= 1, "optim.min_lr_ratio: must be in [0, 1]");
    NEED(c->npaths >= 1, "data.paths: empty");
    NEED(c->val_fraction > 0 && c->val_fraction < 0.5, "data.val_fraction: must be in (0, 0.5)");
    NEED(c->eval_every >= 0 && c->eval_batches >= 1,
         "data.eval_every >= 0 (0: at the end only), data.eval_batches >= 1");
    NEED(c->ckpt_every >= 0, "ckpt.every: must be >= 0");
    NEED(c->ckpt_dir[0] || (!c->ckpt_every && !c->resume), "ckpt.every / --resume need ckpt.dir");
    NEED(c->progress_every >= 1, "log.progress_every: must be >= 1");
    NEED(c->peak_tflops >= 0, "log.peak_tflops: must be >= 0");
    NEED(c->slow_ms >= 0 && c->slow_ms <= 60000, "test.slow_ms: must be in [0, 60000]");
    return 0;
}

double trainer_init_std(const trainer_config_t *c)
{
    return c->init_std > 0 ? c->init_std : sqrt(2.0 / (5.0 * (double)c->hidden));
}

double trainer_lr(const trainer_config_t *c)
{
    return c->lr > 0 ? c->lr : 3e-3 * fmin(1.0, sqrt(256.0 / (double)c->hidden));
}

/* Every mesh of at most max_world ranks that trainer_config_validate accepts for c's model, as
 * [[tp, ep, dp, pp, microbatches], ...]: the elastic launcher picks its meshes from this list
 * (src/elastic/mesh_choice.h), so the trainer's rule is the only one. */
static cJSON *valid_meshes(const trainer_config_t *c, int64_t max_world)
{
    cJSON *list = cJSON_CreateArray();
    trainer_config_t m = *c;
    char err[512];
    for (int64_t w = 1; w <= max_world; w++)
        for (m.tp = 1; m.tp <= w; m.tp++)
            for (m.ep = 1; w % m.tp == 0 && m.ep <= w / m.tp; m.ep++)
                for (m.pp = 1; (w / m.tp) % m.ep == 0 && m.pp <= w / m.tp / m.ep; m.pp++) {
                    if ((w / m.tp / m.ep) % m.pp) continue;
                    m.dp = w / m.tp / m.ep / m.pp;
                    for (m.microbatches = 1; m.microbatches <= c->batch; m.microbatches++) {
                        if (c->batch % m.microbatches ||
                            trainer_config_validate(&m, (int)w, err, sizeof err))
                            continue;
                        const double v[5] = {(double)m.tp, (double)m.ep, (double)m.dp, (double)m.pp,
                                             (double)m.microbatches};
                        cJSON_AddItemToArray(list, cJSON_CreateDoubleArray(v, 5));
                    }
                }
    return list;
}

char *trainer_config_to_json(const trainer_config_t *c)
{
    cJSON *root = cJSON_CreateObject();
    for (int i = 0; i < NKNOBS; i++) {
        const knob_t *k = &knobs[i];
        char sec[32];
        const char *dot = strchr(k->key, '.');
        snprintf(sec, sizeof sec, "%.*s", (int)(dot - k->key), k->key);
        cJSON *s = cJSON_GetObjectItemCaseSensitive(root, sec);
        if (!s) s = cJSON_AddObjectToObject(root, sec);
        const char *base = (const char *)c + k->offset;
        switch (k->type) {
        case K_INT: cJSON_AddNumberToObject(s, dot + 1, (double)*(const int64_t *)base); break;
        case K_FLOAT: cJSON_AddNumberToObject(s, dot + 1, *(const double *)base); break;
        case K_BOOL: cJSON_AddBoolToObject(s, dot + 1, *(const int64_t *)base != 0); break;
        case K_STR: cJSON_AddStringToObject(s, dot + 1, base); break;
        case K_PATHS: {
            cJSON *a = cJSON_AddArrayToObject(s, dot + 1);
            for (int p = 0; p < c->npaths; p++)
                cJSON_AddItemToArray(a, cJSON_CreateString(c->paths[p]));
            break;
        }
        }
    }
    if (c->print_meshes > 0)
        cJSON_AddItemToObject(root, "meshes", valid_meshes(c, c->print_meshes));
    char *text = cJSON_Print(root);
    cJSON_Delete(root);
    return text;
}

void trainer_config_usage(FILE *out)
{
    fprintf(out,
            "usage: mpirun -np N moe_train [--config FILE] [--mesh tp=..,ep=..,dp=..,pp=..]\n"
            "                [--resume] [--print-config [--print-meshes N]] [--plan] [--help]\n"
            "                [--KEY VALUE ...]\n"
            "Trains a byte-level MoE language model (docs/trainer.md). Every key of the JSON\n"
            "config is a flag; flags override the file, which overrides the default.\n"
            "--mesh sets the whole mesh (an axis left out is 1); --data takes every path up to\n"
            "the next flag, once.\n\n");
    for (int i = 0; i < NKNOBS; i++) {
        char flag[64];
        snprintf(flag, sizeof flag, "--%s%s%s", knobs[i].key, knobs[i].alias ? ", " : "",
                 knobs[i].alias ? knobs[i].alias : "");
        fprintf(out, "  %-36s %s\n", flag, knobs[i].help);
    }
}
