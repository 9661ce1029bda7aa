/* The job spec (spec.h): options, and the trainer's model shape from its --print-config. */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "core/env.h"
#include "etcd_server.h"
#include "incarnation_watch.h"
#include "proc.h"
#include "spec.h"

void job_spec_usage(FILE *f)
{
    fprintf(
        f,
        "usage: moe_elastic [options] -- TRAINER [trainer args]\n"
        "Runs a moe_train-compatible trainer (--print-config, --mesh, --train.microbatches,\n"
        "--resume, ckpt.dir and ckpt.every set) as mpirun incarnations; on a lost rank it ends\n"
        "the incarnation, replaces or evicts the rank's slot, picks the largest valid mesh and\n"
        "resumes from the latest complete checkpoint.\n"
        "  --slots N            ranks of the job (the trainer's mesh), default 4\n"
        "  --spares N           spare slots that replace failed ones, default 0\n"
        "  --min-world N        stop (exit 3) below this many ranks, default 1\n"
        "  --max-world N        never run more ranks, default --slots\n"
        "  --ttl-ms MS          a rank's lease TTL (whole seconds, >= 2 s for etcd), default 5000\n"
        "  --max-restarts N     stop (exit 4) after this many restarts, default 10\n"
        "  --grace-ms MS        SIGTERM to SIGKILL when ending an incarnation, default 2000\n"
        "  --start-timeout-ms MS  every rank registered, default 60000\n"
        "  --etcd URL[,URL...]  an existing etcd: its members' client URLs (http://host:port),\n"
        "                       tried in order when one fails; default: a private one\n"
        "  --etcd-members N     the private etcd's members on loopback, default 1 (3: one\n"
        "                       may be lost)\n"
        "  --etcd-binary PATH   the private etcd's program, default etcd\n"
        "  --events FILE        JSON-lines events, default elastic-events.jsonl\n"
        "  --mpirun-log FILE    mpirun's whole output (appended), default elastic-mpirun.log\n"
        "  --job NAME           etcd keys under /moe/NAME/, default job\n"
        "  --mpirun PATH        default mpirun\n"
        "  --mpirun-arg ARG     passed to mpirun (repeatable), e.g. --oversubscribe\n"
        "Agent mode, one per host of a multi-host job (docs/elastic.md):\n"
        "  --agent [--host NAME] --slots N --ranks R --etcd URL[,URL...]\n"
        "                       this host's N slots (NAME: as mpirun reaches it, default its\n"
        "                       hostname); the job runs R ranks over the hosts (the\n"
        "                       trainer's mesh), launched by the elected leader with mpirun\n"
        "                       over a hostfile; every agent gets the same other options\n"
        "  --host-session       the host's ranks are those of the agent's session (hosts\n"
        "                       simulated on one machine)\n");
    straggler_usage(f);
    fprintf(f,
            "exit: 0 done; 1 launcher failure; 2 bad arguments; 3 too few ranks or no valid mesh;\n"
            "4 max restarts reached.\n");
}

int job_spec_request_ms(const job_spec_t *s)
{
    int ms = s->ttl_ms / 4;
    return ms < 250 ? 250 : ms > 2000 ? 2000 : ms;
}

static int int_arg(const char *flag, const char *v, int lo, int *out, char *err, size_t len)
{
    char *end;
    long x = v ? strtol(v, &end, 10) : 0;
    if (!v || !*v || *end || x < lo || x > 1000000000) {
        snprintf(err, len, "%s: \"%s\" is not an integer >= %d", flag, v ? v : "", lo);
        return -1;
    }
    *out = (int)x;
    return 0;
}

int job_spec_parse(job_spec_t *s, int argc, char **argv, char *err, size_t len)
{
    *s = (job_spec_t){.slots = 4,
                      .min_world = 1,
                      .max_world = 0,
                      .ttl_ms = 5000,
                      .max_restarts = 10,
                      .grace_ms = 2000,
                      .start_timeout_ms = 60000,
                      .poll_ms = 100,
                      .etcd_members = 1,
                      .etcd_binary = "etcd",
                      .events = "elastic-events.jsonl",
                      .mpirun_log = "elastic-mpirun.log",
                      .mpirun = "mpirun",
                      .job = "job"};
    straggler_config_default(&s->straggler);
    int i = 1;
    for (; i < argc && strcmp(argv[i], "--"); i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int rc = 0;
        if (!strcmp(a, "--help") || !strcmp(a, "-h"))
            return 1;
        else if (!strcmp(a, "--slots"))
            rc = int_arg(a, v, 1, &s->slots, err, len), i++;
        else if (!strcmp(a, "--spares"))
            rc = int_arg(a, v, 0, &s->spares, err, len), i++;
        else if (!strcmp(a, "--min-world"))
            rc = int_arg(a, v, 1, &s->min_world, err, len), i++;
        else if (!strcmp(a, "--max-world"))
            rc = int_arg(a, v, 1, &s->max_world, err, len), i++;
        else if (!strcmp(a, "--ttl-ms"))
            rc = int_arg(a, v, 1, &s->ttl_ms, err, len), i++;
        else if (!strcmp(a, "--max-restarts"))
            rc = int_arg(a, v, 0, &s->max_restarts, err, len), i++;
        else if (!strcmp(a, "--grace-ms"))
            rc = int_arg(a, v, 0, &s->grace_ms, err, len), i++;
        else if (!strcmp(a, "--start-timeout-ms"))
            rc = int_arg(a, v, 1, &s->start_timeout_ms, err, len), i++;
        else if (!strcmp(a, "--etcd") && v)
            s->etcd = v, i++;
        else if (!strcmp(a, "--agent"))
            s->agent = true;
        else if (!strcmp(a, "--host-session"))
            s->host_session = true;
        else if (!strcmp(a, "--host") && v && *v && !strchr(v, '/'))
            s->host = v, i++;
        else if (!strcmp(a, "--ranks"))
            rc = int_arg(a, v, 1, &s->ranks, err, len), i++;
        else if (!strcmp(a, "--etcd-members"))
            rc = int_arg(a, v, 1, &s->etcd_members, err, len), i++;
        else if (!strcmp(a, "--etcd-binary") && v)
            s->etcd_binary = v, i++;
        else if (!strcmp(a, "--events") && v)
            s->events = v, i++;
        else if (!strcmp(a, "--mpirun-log") && v)
            s->mpirun_log = v, i++;
        else if (!strcmp(a, "--job") && v && *v && !strchr(v, '/'))
            s->job = v, i++;
        else if (!strcmp(a, "--mpirun") && v)
            s->mpirun = v, i++;
        else if (!strncmp(a, "--straggler-", 12)) {
            if (straggler_parse_option(&s->straggler, a, v, err, len) < 0) return -1;
            i++;
        } else if (!strcmp(a, "--mpirun-arg") && v) {
            if (s->n_mpirun_args == SPEC_MAX_MPIRUN_ARGS) {
                snprintf(err, len, "--mpirun-arg: at most %d", SPEC_MAX_MPIRUN_ARGS);
                return -1;
            }
            s->mpirun_args[s->n_mpirun_args++] = v;
            i++;
        } else {
            snprintf(err, len, "%s: unknown option%s (see --help)", a,
                     v ? "" : " or missing value");
            return -1;
        }
        if (rc) return -1;
    }
    if (i + 1 >= argc) {
        snprintf(err, len, "no trainer command: moe_elastic [options] -- TRAINER [args]");
        return -1;
    }
    s->trainer = argv + i + 1;
    s->n_trainer = argc - i - 1;
    if (s->slots + s->spares > WATCH_MAX_RANKS) {
        snprintf(err, len, "--slots %d + --spares %d: at most %d slots", s->slots, s->spares,
                 WATCH_MAX_RANKS);
        return -1;
    }
    if (s->etcd_members > ETCD_SERVER_MAX_MEMBERS || (s->etcd && s->etcd_members != 1)) {
        snprintf(err, len,
                 "--etcd-members %d: the private etcd has 1 to %d members, and none "
                 "with --etcd",
                 s->etcd_members, ETCD_SERVER_MAX_MEMBERS);
        return -1;
    }
    if (s->agent && !s->host && gethostname(s->host_name, sizeof s->host_name - 1) == 0 &&
        s->host_name[0] && !strchr(s->host_name, '/'))
        s->host = s->host_name;
    if (s->agent && (!s->host || !s->etcd || !s->ranks)) {
        snprintf(err, len,
                 "--agent needs --ranks N (the job's ranks), --etcd URL[,URL...] (the "
                 "agents meet in etcd) and a host name (--host NAME, or gethostname)");
        return -1;
    }
    if (!s->agent && (s->host || s->ranks || s->host_session)) {
        snprintf(err, len, "--host, --ranks and --host-session are for --agent");
        return -1;
    }
    if (!s->max_world) s->max_world = s->agent ? s->ranks : s->slots;
    if (s->min_world > s->max_world || (!s->agent && s->min_world > s->slots)) {
        snprintf(err, len, "--min-world %d is above --max-world %d or --slots %d", s->min_world,
                 s->max_world, s->slots);
        return -1;
    }
    return 0;
}

static int64_t get_i64(const cJSON *root, const char *section, const char *key, int *missing)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(
        cJSON_GetObjectItemCaseSensitive(root, section), key);
    if (!cJSON_IsNumber(v)) {
        *missing = 1;
        return 0;
    }
    return (int64_t)v->valuedouble;
}

int trainer_info_query(const job_spec_t *s, trainer_info_t *info, char *err, size_t len)
{
    char np[16];
    snprintf(np, sizeof np, "%d", s->slots);
    char np_all[16];
    snprintf(np_all, sizeof np_all, "%d", s->slots + s->spares);
    char **argv = calloc((size_t)(s->n_mpirun_args + s->n_trainer + 8), sizeof *argv);
    if (!argv) {
        snprintf(err, len, "out of memory");
        return -1;
    }
    int n = 0;
    argv[n++] = (char *)s->mpirun;
    argv[n++] = "-np";
    argv[n++] = np;
    for (int i = 0; i < s->n_mpirun_args; i++) argv[n++] = (char *)s->mpirun_args[i];
    for (int i = 0; i < s->n_trainer; i++) argv[n++] = s->trainer[i];
    argv[n++] = "--print-config";
    argv[n++] = "--print-meshes"; /* the trainer's own list of valid meshes (mesh_choice.h) */
    argv[n++] = np_all;
    size_t cap = 16u << 20;
    char *out = malloc(cap);
    if (!out) {
        free(argv);
        snprintf(err, len, "out of memory");
        return -1;
    }
    int status = proc_run_capture(argv, 120.0, out, cap);
    free(argv);
    const char *root_ok = moe_env_string(MOE_ENV_OMPI_ALLOW_ROOT, NULL);
    if (status != 0) free(out);
    if (status != 0 && geteuid() == 0 && !(root_ok && *root_ok)) {
        snprintf(err, len,
                 "%s refused to run as root (Open MPI needs OMPI_ALLOW_RUN_AS_ROOT=1 "
                 "and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 in the environment, or a user that is "
                 "not root)",
                 s->mpirun);
        return -1;
    }
    if (status != 0) {
        snprintf(err, len,
                 "the trainer's --print-config on %d ranks failed (%s %d): its "
                 "arguments or mesh do not fit the job",
                 s->slots, status < 0 ? "could not run, or timed out:" : "wait status", status);
        return -1;
    }
    /* the JSON object is the output's first '{' to its end (rank 0 prints it alone) */
    cJSON *root = strchr(out, '{') ? cJSON_Parse(strchr(out, '{')) : NULL;
    free(out);
    int missing = 0;
    el_model_shape_t *sh = &info->shape;
    const cJSON *meshes = cJSON_GetObjectItemCaseSensitive(root, "meshes");
    int n_meshes = cJSON_IsArray(meshes) ? cJSON_GetArraySize(meshes) : 0;
    el_mesh_t *valid = calloc((size_t)(n_meshes ? n_meshes : 1), sizeof *valid);
    sh->valid = valid;
    sh->n_valid = 0;
    missing |= !cJSON_IsArray(meshes) || !valid;
    for (const cJSON *m = cJSON_IsArray(meshes) ? meshes->child : NULL; m && valid; m = m->next) {
        int64_t v[5];
        bool ok = cJSON_IsArray(m) && cJSON_GetArraySize(m) == 5;
        for (int k = 0; ok && k < 5; k++) {
            const cJSON *x = cJSON_GetArrayItem(m, k);
            ok = cJSON_IsNumber(x);
            v[k] = ok ? (int64_t)x->valuedouble : 0;
        }
        missing |= !ok;
        if (ok) valid[sh->n_valid++] = (el_mesh_t){v[0], v[1], v[2], v[3], v[4]};
    }
    sh->job.microbatches = get_i64(root, "train", "microbatches", &missing);
    sh->job.tp = get_i64(root, "mesh", "tp", &missing);
    sh->job.ep = get_i64(root, "mesh", "ep", &missing);
    sh->job.dp = get_i64(root, "mesh", "dp", &missing);
    sh->job.pp = get_i64(root, "mesh", "pp", &missing);
    info->steps = get_i64(root, "train", "steps", &missing);
    info->ckpt_every = get_i64(root, "ckpt", "every", &missing);
    const cJSON *dir = cJSON_GetObjectItemCaseSensitive(
        cJSON_GetObjectItemCaseSensitive(root, "ckpt"), "dir");
    snprintf(info->ckpt_dir, sizeof info->ckpt_dir, "%s",
             cJSON_IsString(dir) ? dir->valuestring : "");
    cJSON_Delete(root);
    if (!root || missing) {
        snprintf(err, len,
                 "the trainer's --print-config --print-meshes N is not the JSON "
                 "moe_train prints (mesh, train, ckpt sections and the meshes list)");
        return -1;
    }
    /* --print-config checks the mesh's shape but not the world (it prints any config) */
    const el_mesh_t *jm = &sh->job;
    if (jm->tp * jm->ep * jm->dp * jm->pp != s->slots) {
        snprintf(err, len,
                 "the trainer's --print-config mesh tp*ep*dp*pp = "
                 "%lld*%lld*%lld*%lld does not fit the job's %d slots",
                 (long long)jm->tp, (long long)jm->ep, (long long)jm->dp, (long long)jm->pp,
                 s->slots);
        return -1;
    }
    if (!info->ckpt_dir[0] || info->ckpt_every <= 0) {
        snprintf(err, len,
                 "the trainer needs ckpt.dir and ckpt.every > 0 (--ckpt-dir, "
                 "--ckpt-every): a restart resumes from its checkpoints");
        return -1;
    }
    return 0;
}

void trainer_info_free(trainer_info_t *info)
{
    free((void *)info->shape.valid);
    info->shape.valid = NULL;
    info->shape.n_valid = 0;
}
