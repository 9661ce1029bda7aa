# Elastic training, the ranks' side and the launcher's: the etcd v3 JSON gateway client
# (etcd.c), a rank's lease and progress keys (member.c, moe/elastic.h) and the launcher's
# choice of mesh on the slots left (mesh_choice.c).
list(APPEND MOE_SOURCES src/elastic/etcd.c src/elastic/member.c src/elastic/mesh_choice.c)
list(APPEND MOE_PRIVATE_LIBS PkgConfig::MOE_CJSON PkgConfig::MOE_CRYPTO CURL::libcurl
     Threads::Threads)
