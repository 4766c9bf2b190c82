// TwoConsumerConv: plain CUDA included by conv_sm90.cu.j2 inside the kernel namespace (fwd / bwd_data with warps
// [8, 1, 1]), after ConvBase, the collectives and PRODUCER_REGISTERS / CONSUMER_REGISTERS.
#pragma once
// ---- two consumer warpgroups on one output tile (warps [8, 1, 1]) ------------------------------------
// CUTLASS 4.2's SM90 conv kernel (GemmUniversal's non-persistent TMA warp-specialized body) runs one consumer
// warpgroup, so a tile holds at most 128 x 128 fp32 accumulators (128 registers a thread); the dispatch policy
// rejects the cooperative schedule outright. This body keeps CUTLASS's Params, shared storage, grid and host
// side (the base class) and the same collectives, and runs the mainloop's TiledMma over two warpgroups stacked
// along M: tiles up to 128 x 256 / 256 x 128 read fewer shared-memory bytes per flop, and one producer feeds 8
// math warps (with its registers: PRODUCER_REGISTERS / CONSUMER_REGISTERS).
struct TwoConsumerConv : ConvBase {
  using Base = ConvBase;
  using Params = Base::Params;
  using SharedStorage = Base::SharedStorage;
  using TiledMma = Base::TiledMma;
  using TileShape = Base::TileShape;
  using ClusterShape = Base::ClusterShape;
  static constexpr int MMA_THREADS = int(cute::size(TiledMma{}));
  static_assert(MMA_THREADS == 2 * cutlass::NumThreadsPerWarpGroup, "two consumer warpgroups");
  static_assert(int(Base::MaxThreadsPerBlock) == MMA_THREADS + cutlass::NumThreadsPerWarpGroup, "one producer warpgroup");

  CUTLASS_DEVICE void operator()(const Params& params, char* smem) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace cute;
    using MainloopPipeline = typename CollectiveMainloop::MainloopPipeline;
    using EpiLoadPipeline = typename CollectiveEpilogue::LoadPipeline;
    using EpiStorePipeline = typename CollectiveEpilogue::StorePipeline;
    SharedStorage& storage = *reinterpret_cast<SharedStorage*>(smem);
    const int warp = cutlass::canonical_warp_idx_sync();
    const int lane = cutlass::canonical_lane_idx();
    const bool producer = cutlass::canonical_warp_group_idx() == 0;
    const bool load_warp = producer && warp == 0;  // the producer's other warps idle
    const int wg_thread = int(threadIdx.x) % cutlass::NumThreadsPerWarpGroup;
    const int mma_thread = int(threadIdx.x) - cutlass::NumThreadsPerWarpGroup;  // [0, 256) over both consumers
    if (warp == 0 && elect_one_sync()) {
      CollectiveMainloop::prefetch_tma_descriptors(params.mainloop);
      CollectiveEpilogue::prefetch_tma_descriptors(params.epilogue);
    }

    typename MainloopPipeline::Params mainloop_params;
    if (load_warp) mainloop_params.role = MainloopPipeline::ThreadCategory::Producer;
    if (!producer) mainloop_params.role = MainloopPipeline::ThreadCategory::Consumer;
    mainloop_params.is_leader = wg_thread == 0;  // one arrival per consumer warpgroup
    mainloop_params.num_consumers = MMA_THREADS;
    mainloop_params.transaction_bytes = params.mainloop.tma_transaction_bytes;
    MainloopPipeline mainloop_pipeline(storage.pipelines.mainloop, mainloop_params, ClusterShape{});

    // C (the old output) is loaded only when beta != 0
    typename EpiLoadPipeline::Params epi_load_params;
    if (load_warp) epi_load_params.role = EpiLoadPipeline::ThreadCategory::Producer;
    if (!producer) epi_load_params.role = EpiLoadPipeline::ThreadCategory::Consumer;
    epi_load_params.dst_blockid = cute::block_rank_in_cluster();
    epi_load_params.producer_arv_count = cutlass::NumThreadsPerWarp;
    epi_load_params.consumer_arv_count = MMA_THREADS;
    if constexpr (CollectiveEpilogue::RequiresTransactionBytes)
      epi_load_params.transaction_bytes = params.epilogue.tma_transaction_bytes;
    EpiLoadPipeline epi_load_pipeline(storage.pipelines.epi_load, epi_load_params);
    typename EpiStorePipeline::Params epi_store_params;
    epi_store_params.always_wait = true;
    EpiStorePipeline epi_store_pipeline(epi_store_params);

    // the barriers are initialized before any CTA of the cluster waits on them
    if constexpr (size(ClusterShape{}) > 1) cute::cluster_arrive_relaxed();
    else __syncthreads();

    const auto shape = append<4>(params.problem_shape, Int<1>{});
    const auto blk_shape = TileShape{};
    TiledMma tiled_mma;
    CollectiveMainloop mainloop;
    CollectiveEpilogue epilogue(params.epilogue, storage.tensors.epilogue);
    const auto inputs = mainloop.load_init(shape, params.mainloop);
    const auto blk_coord = make_coord(idx2crd(int(blockIdx.x), cute::shape<2>(get<0>(inputs))),
                                      idx2crd(int(blockIdx.y), cute::shape<2>(get<1>(inputs))), _, Int<0>{});
    const int k_tiles = int(size<3>(get<0>(inputs)));
    if constexpr (size(ClusterShape{}) > 1) cute::cluster_wait();

    if (producer) {
      cutlass::arch::warpgroup_reg_dealloc<PRODUCER_REGISTERS>();
      if (load_warp) {
        auto load_state = cutlass::make_producer_start_state<MainloopPipeline>();
        mainloop.load(params.mainloop, mainloop_pipeline, load_state, inputs, blk_coord,
                      make_coord_iterator(cute::shape<3>(get<0>(inputs))), k_tiles, lane,
                      cute::block_rank_in_cluster(), storage.tensors.mainloop);
        load_state.advance(k_tiles);
        // every stage released by the consumers: the epilogue's C tiles may reuse the main loop's shared memory
        mainloop.load_tail(mainloop_pipeline, load_state);
        if (epilogue.is_producer_load_needed()) {
          __syncwarp();
          auto epi_state = epilogue.load(epi_load_pipeline, cutlass::make_producer_start_state<EpiLoadPipeline>(),
                                         shape, blk_shape, blk_coord, tiled_mma, lane, storage.tensors.epilogue);
          epilogue.load_tail(epi_load_pipeline, epi_state);
        }
      }
    } else {
      cutlass::arch::warpgroup_reg_alloc<CONSUMER_REGISTERS>();
      Tensor acc = partition_fragment_C(tiled_mma, take<0, 2>(blk_shape));
      typename CollectiveMainloop::PipelineState mma_state;
      mainloop.mma(mainloop_pipeline, mma_state, acc, k_tiles, mma_thread, storage.tensors.mainloop, params.mainloop);
      mainloop.mma_tail(mainloop_pipeline, mma_state, k_tiles);
      typename CollectiveEpilogue::LoadPipelineState epi_load_state;
      auto [epi_load_next, epi_store_next] =
          epilogue.store(epi_load_pipeline, epi_load_state, epi_store_pipeline,
                         cutlass::make_producer_start_state<EpiStorePipeline>(), shape, blk_shape, blk_coord, acc,
                         tiled_mma, mma_thread, storage.tensors.epilogue);
      epilogue.store_tail(epi_load_pipeline, epi_load_next, epi_store_pipeline, epi_store_next);
    }
#endif
  }
};

