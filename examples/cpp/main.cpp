// libmoe from C++: RAII handles over the C API and a small training loop.
//
// The C API is plain C; C++ trainers wrap it once: a handle type that calls the matching
// destroy, and a check() that turns a failing moe_status_t into an exception carrying the
// status and moe_last_error(). The loop teaches a student MoE layer a teacher layer's outputs
// with libmoe's AdamW (mean squared error) and exits 1 unless the loss falls below a third of
// its start.
//
// Shapes: N tokens, H hidden, F expert FFN width, E experts, K top-k.
// Build: against an installed libmoe, `cmake -S examples/cpp -B b -DCMAKE_PREFIX_PATH=<prefix>`
// (find_package(libmoe)); inside libmoe's own build it is the target moe_cpp_example.
#include <moe/moe.h>

#include <cstdio>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace moe {

class Error : public std::runtime_error {
  public:
    Error(moe_status_t status, const char *call)
        : std::runtime_error(std::string(call) + ": " + moe_status_string(status) + ": " +
                             moe_last_error()),
          status(status) {}
    moe_status_t status;
};

inline void check(moe_status_t status, const char *call)
{
    if (status != MOE_STATUS_SUCCESS) throw Error(status, call);
}
#define MOE_CHECK(call) ::moe::check((call), #call)

// A handle owned by a unique_ptr whose deleter is the C destroy; destroy(NULL) is a no-op, and
// destroy errors cannot be thrown from a destructor (call the destroy yourself to see them).
template <typename T, moe_status_t (*Destroy)(T *)>
struct Deleter {
    void operator()(T *p) const { (void)Destroy(p); }
};
using Runtime = std::unique_ptr<moe_runtime_t, Deleter<moe_runtime_t, moe_runtime_destroy>>;
using Layer = std::unique_ptr<moe_layer_t, Deleter<moe_layer_t, moe_layer_destroy>>;
using AdamW = std::unique_ptr<moe_adamw_t, Deleter<moe_adamw_t, moe_adamw_destroy>>;

inline Runtime make_runtime(moe_backend_kind_t backend, uint64_t seed)
{
    moe_runtime_config_t cfg = moe_runtime_config_default();
    cfg.backend = backend;
    cfg.seed = seed;
    moe_runtime_t *rt = nullptr;
    MOE_CHECK(moe_runtime_create(&cfg, &rt));
    return Runtime(rt);
}

inline Layer make_layer(moe_runtime_t *rt, const moe_layer_config_t &cfg)
{
    moe_layer_t *layer = nullptr;
    MOE_CHECK(moe_layer_create(rt, &cfg, &layer));
    return Layer(layer);
}

inline AdamW make_adamw(moe_runtime_t *rt, float lr)
{
    moe_adamw_config_t cfg = moe_adamw_config_default();
    cfg.lr = lr;
    cfg.weight_decay = 0.0f;
    moe_adamw_t *opt = nullptr;
    MOE_CHECK(moe_adamw_create(rt, &cfg, &opt));
    return AdamW(opt);
}

// A [rows, cols] f32 view of a vector (host backend: caller-owned memory, no copy).
inline moe_tensor_t view(std::vector<float> &v, int64_t rows, int64_t cols)
{
    const int64_t shape[2] = {rows, cols};
    moe_tensor_t t;
    MOE_CHECK(moe_tensor_view(v.data(), MOE_DTYPE_F32, MOE_DEVICE_HOST, 2, shape, &t));
    return t;
}

}  // namespace moe

int main()
{
    const int64_t N = 64, H = 16, F = 32;
    try {
        std::printf("libmoe %s (built against %d)\n", moe_version_string(), MOE_VERSION);
        moe::Runtime teacher_rt = moe::make_runtime(MOE_BACKEND_HOST, 1);
        moe::Runtime rt = moe::make_runtime(MOE_BACKEND_HOST, 2);
        moe_layer_config_t cfg = moe_layer_config_default();
        cfg.hidden = H;
        cfg.ffn_hidden = F;
        cfg.num_experts = 4;
        cfg.top_k = 2;
        cfg.init_std = 0.3f;
        moe::Layer teacher = moe::make_layer(teacher_rt.get(), cfg);
        moe::Layer student = moe::make_layer(rt.get(), cfg);
        moe::AdamW opt = moe::make_adamw(rt.get(), 2e-2f);
        MOE_CHECK(moe_adamw_add_layer(opt.get(), student.get(), nullptr));

        std::mt19937 gen(3);
        std::normal_distribution<float> normal;
        std::vector<float> x(N * H), target(N * H), y(N * H), dy(N * H);
        for (float &v : x) v = normal(gen);
        moe_tensor_t xt = moe::view(x, N, H), tt = moe::view(target, N, H);
        moe_tensor_t yt = moe::view(y, N, H), dyt = moe::view(dy, N, H);
        MOE_CHECK(moe_layer_forward(teacher.get(), 0, &xt, &tt));
        MOE_CHECK(moe_layer_release_slot(teacher.get(), 0));

        double first = 0, last = 0;
        for (int step = 0; step < 80; step++) {
            MOE_CHECK(moe_layer_discard_grad(student.get()));
            MOE_CHECK(moe_layer_forward(student.get(), 0, &xt, &yt));
            double loss = 0;
            for (int64_t i = 0; i < N * H; i++) {
                const double d = y[i] - target[i];
                loss += d * d / double(N * H);
                dy[i] = float(2 * d / double(N * H));
            }
            MOE_CHECK(moe_layer_backward(student.get(), 0, &dyt, nullptr));
            MOE_CHECK(moe_adamw_step(opt.get(), 0.0f, 1.0f));
            if (step == 0) first = loss;
            last = loss;
        }
        std::printf("loss %.5f -> %.5f over 80 AdamW steps\n", first, last);

        try {  // a failing call throws with the library's message
            moe_layer_config_t bad = cfg;
            bad.top_k = 9;
            moe::make_layer(rt.get(), bad);
        } catch (const moe::Error &e) {
            std::printf("expected failure: %s\n", e.what());
        }
        if (!(last < first / 3)) {
            std::fprintf(stderr, "the loss did not fall enough\n");
            return 1;
        }
    } catch (const moe::Error &e) {
        std::fprintf(stderr, "%s\n", e.what());
        return 1;
    }
    return 0;  // opt, the layers and the runtimes are destroyed in reverse order
}
