# epd's build. Plain GNU make: `make` builds build/epd, build/epctl, libepd and the tests' binaries.
#   make CUDA=0            CPU-only daemon (CUDA is used when $(CUDA_HOME)/bin/nvcc exists)
#   make MPI_HOME=PREFIX   build against the MPI in PREFIX (e.g. the CUDA-aware one of scripts/cuda-mpi.sh)
#   make check             warnings are errors; unit tests (plain and ASan+UBSan), integration tests
#   make demo              2 CPU ranks, epctl bench in BF16 then FP8, graceful stop
#   make V=1               print every command (the default is one short line per file)
# Each folder adds its sources and tests in its module.mk.

VERSION   := 0.1.0
BUILD     ?= build
PREFIX    ?= /usr/local
DESTDIR   ?=
CUDA_HOME ?= /usr/local/cuda
MPI_HOME  ?=
CC        ?= cc
ifeq ($(origin CC),default)
CC := gcc
endif

# Configuration is probed lazily (=), so `make check` on a fresh machine can install the
# dependencies before anything asks mpicc or pkg-config.
MPICC     = $(if $(MPI_HOME),$(MPI_HOME)/bin/mpicc,mpicc)
MPIRUN    = $(if $(MPI_HOME),$(MPI_HOME)/bin/mpirun,mpirun)
MPI_CFLAGS = $(shell $(MPICC) --showme:compile 2>/dev/null)
MPI_LIBS   = $(shell $(MPICC) --showme:link 2>/dev/null) $(if $(MPI_HOME),-Wl$(comma)-rpath$(comma)$(MPI_HOME)/lib)
PKGS       = libevent libevent_pthreads yaml-0.1 libcjson
PKG_CFLAGS = $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS   = $(shell pkg-config --libs $(PKGS) 2>/dev/null)
CMOCKA_CFLAGS = $(shell pkg-config --cflags cmocka 2>/dev/null)
CMOCKA_LIBS   = $(shell pkg-config --libs cmocka 2>/dev/null)
comma := ,

ifeq ($(origin CUDA),undefined)
CUDA := $(if $(wildcard $(CUDA_HOME)/bin/nvcc),1,0)
endif
NVCC ?= $(CUDA_HOME)/bin/nvcc
ifeq ($(CUDA),1)
NCCL_HOME ?=
ifeq ($(origin NCCL),undefined)
NCCL := $(if $(wildcard $(CUDA_HOME)/include/nccl.h $(if $(NCCL_HOME),$(NCCL_HOME)/include/nccl.h) /usr/include/nccl.h),1,0)
endif
else
NCCL := 0
endif

WERROR   ?= 0
OPT      ?= -O2
CSTD     := -std=gnu11
WARN     := -Wall -Wextra -Wshadow -Wno-unused-parameter $(if $(filter 1,$(WERROR)),-Werror)
# No contraction of a*b+c into an FMA anywhere: host and device results must match bit for bit.
NUMERIC  := -ffp-contract=off -fno-fast-math
DEFS     := -D_GNU_SOURCE $(if $(filter 1,$(CUDA)),-DEPD_HAVE_CUDA=1) $(if $(filter 1,$(NCCL)),-DEPD_HAVE_NCCL=1) \
            -DEPD_VERSION=\"$(VERSION)\"
BASE_CFLAGS = $(CSTD) $(OPT) -g $(WARN) $(NUMERIC) $(DEFS) -I. $(if $(NCCL_HOME),-I$(NCCL_HOME)/include) -fPIC $(MPI_CFLAGS) $(PKG_CFLAGS) $(CFLAGS)
SAN_FLAGS := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
CUDA_LIBS  = $(if $(filter 1,$(CUDA)),-L$(CUDA_HOME)/lib64 -Wl$(comma)-rpath$(comma)$(CUDA_HOME)/lib64 -lcudart \
             $(if $(filter 1,$(NCCL)),$(if $(NCCL_HOME),-L$(NCCL_HOME)/lib -Wl$(comma)-rpath$(comma)$(NCCL_HOME)/lib) -lnccl))
LDLIBS_ALL = $(PKG_LIBS) $(MPI_LIBS) $(CUDA_LIBS) -lpthread -lm $(LDFLAGS)
# Hopper: real code for sm_90a plus PTX for later chips; never fast math, never FMA contraction.
NVCC_FLAGS ?= -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -gencode arch=compute_90,code=compute_90 \
              --fmad=false -Xcompiler -fPIC -I. $(if $(NCCL_HOME),-I$(NCCL_HOME)/include) $(DEFS) $(if $(filter 1,$(WERROR)),-Werror all-warnings) \
              -Xcompiler -Wall

# Quiet build: one line per target ("  CC  build/obj/x.o"); `make V=1` prints the commands.
V ?= 0
say = $(if $(filter 1,$(V)),,@printf '  %-5s %s\n' '$(1)' '$@';)

# Filled by the module.mk files.
COMMON_SRCS :=
CONFIG_SRCS :=
PROTO_SRCS  :=
GPU_SRCS    :=
GPU_CU_SRCS :=
COMM_SRCS   :=
COMM_CU_SRCS:=
DAEMON_SRCS :=
EPCTL_SRCS  :=
UNIT_TESTS  :=
BINS        :=
GPU_TESTS   :=

# Object paths of sources; defined before the module.mk files use them in prerequisites.
obj     = $(patsubst %.c,$(BUILD)/obj/%.o,$(filter %.c,$(1))) $(patsubst %.cu,$(BUILD)/obj/%.cu.o,$(filter %.cu,$(1)))
asanobj = $(patsubst %.c,$(BUILD)/asan/%.o,$(1))

include $(sort $(wildcard */module.mk))
-include tests/*/module.mk

ifneq ($(CUDA),1)
GPU_CU_SRCS :=
COMM_CU_SRCS :=
endif


.PHONY: all check check-run deps demo demo-run install uninstall clean print-build fuzz gpu-check
.DEFAULT_GOAL := all

all: print-build $(BINS) $(foreach t,$(UNIT_TESTS),$(BUILD)/tests/test_$(t))

print-build:
	@echo "epd build: CUDA=$(CUDA)$(if $(filter 1,$(CUDA)), ($(NVCC)))  NCCL=$(NCCL)  MPI=$(if $(MPI_HOME),$(MPI_HOME),system mpicc)  WERROR=$(WERROR)"

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(call say,CC)$(CC) $(BASE_CFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/obj/%.cu.o: %.cu
	@mkdir -p $(dir $@)
	$(call say,NVCC)$(NVCC) $(NVCC_FLAGS) $(MPI_CFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/asan/%.o: %.c
	@mkdir -p $(dir $@)
	$(call say,CC)$(CC) $(BASE_CFLAGS) $(SAN_FLAGS) -UEPD_HAVE_CUDA -UEPD_HAVE_NCCL -MMD -MP -c $< -o $@

# A unit test links its own module's sources only (test_<m>_SRCS), plus cmocka.
define unit_test_rules
$(BUILD)/tests/test_$(1): $(BUILD)/obj/tests/unit/test_$(1).o $(call obj,$(test_$(1)_SRCS))
	@mkdir -p $$(dir $$@)
	$$(call say,LD)$$(CC) $$(BASE_CFLAGS) -o $$@ $$^ $$(CMOCKA_LIBS) $$(LDLIBS_ALL)
$(BUILD)/asan/tests/test_$(1): $(BUILD)/asan/tests/unit/test_$(1).o $(call asanobj,$(filter %.c,$(test_$(1)_SRCS)))
	@mkdir -p $$(dir $$@)
	$$(call say,LD)$$(CC) $$(BASE_CFLAGS) $$(SAN_FLAGS) -UEPD_HAVE_CUDA -o $$@ $$^ $$(CMOCKA_LIBS) $$(PKG_LIBS) $$(MPI_LIBS) -lpthread -lm
endef
$(foreach t,$(UNIT_TESTS),$(eval $(call unit_test_rules,$(t))))

deps:
	@scripts/deps.sh

# check: dependencies first, then a fresh make (so the probes above see them), warnings as errors.
check: deps
	@$(MAKE) --no-print-directory WERROR=1 check-run

check-run: all $(foreach t,$(UNIT_TESTS),$(BUILD)/asan/tests/test_$(t))
	@BUILD=$(BUILD) MPIRUN=$(MPIRUN) UNIT_TESTS="$(UNIT_TESTS)" GPU_TESTS="$(GPU_TESTS)" tests/run.sh

demo: deps
	@$(MAKE) --no-print-directory demo-run

demo-run: all
	@BUILD=$(BUILD) MPIRUN=$(MPIRUN) scripts/demo.sh

# install: binaries, library, units, launcher, man pages, docs; the config in SYSCONFDIR only
# when none is there (systemd/module.mk). uninstall removes what install put under PREFIX and
# leaves the config (it is the operator's).
install: all
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/lib/pkgconfig $(DESTDIR)$(PREFIX)/include
	install -m 0755 $(filter $(BUILD)/epd $(BUILD)/epctl,$(BINS)) $(DESTDIR)$(PREFIX)/bin/
	$(INSTALL_EXTRA)

UNINSTALL_FILES += bin/epd bin/epctl lib/libepd.a lib/libepd.so lib/$(LIBEPD_SONAME) \
    include/epd.h lib/pkgconfig/epd.pc
uninstall:
	rm -f $(addprefix $(DESTDIR)$(PREFIX)/,$(UNINSTALL_FILES))
	-rmdir $(addprefix $(DESTDIR)$(PREFIX)/,$(UNINSTALL_DIRS)) 2>/dev/null
	@echo "kept $(DESTDIR)$(SYSCONFDIR)/epd/ and $(DESTDIR)$(SYSCONFDIR)/default/epd (remove them by hand)"

clean:
	rm -rf $(BUILD)

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
